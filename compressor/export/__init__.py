"""Deployment: the files an app ships, and the runtimes that load them.

    onnxfile   PyTorch -> one ONNX file at exactly the opset/IR asked for; parity, invariants
    int8       which nodes run in INT8 for a target (mobile: reproducible; host: timed)
    qdq        ORT's quantizer calibrated once, and the Q/DQ graph surgery around it
    checks     ORT sessions and top-1 agreement with FP32 (ties, the bound on new inputs)
    biascorr   each INT8 node's own error; empirical bias correction (Nagel et al. 2019)
    fallback   the INT8 fallback search: prefixes, bisection, delta debugging
    compat     versions read back from a file; the oldest ONNX Runtime that loads it
    mobile     .ort conversion, NNAPI/CoreML verdicts, fixed-batch copies
    protos     ModelProto plumbing that keeps memory near one copy of the weights

`from compressor import export` gives the ONNX-file functions below (the module every caller
used before this package existed); the other modules are imported by name. onnx and
onnxruntime are imported inside functions, so importing this package stays light.
"""

from compresskit.compressor.export.onnxfile import (
    QUANTIZABLE,
    ExportConfig,
    QuantConfig,
    agreement,
    check,
    check_calibration,
    check_runtime_opset,
    clearly_faster,
    errors_only,
    export_onnx,
    fp32_only_nodes,
    input_info,
    load_calibration,
    ort_baselines,
    output_info,
    parity,
    predict,
    preprocess,
    probe_opset,
    quantizable_nodes,
    quantize_int8,
    run,
    runtime_runs,
    torch_logits,
    weight_invariants,
)

__all__ = [
    "QUANTIZABLE",
    "ExportConfig",
    "QuantConfig",
    "agreement",
    "check",
    "check_calibration",
    "check_runtime_opset",
    "clearly_faster",
    "errors_only",
    "export_onnx",
    "fp32_only_nodes",
    "input_info",
    "load_calibration",
    "ort_baselines",
    "output_info",
    "parity",
    "predict",
    "preprocess",
    "probe_opset",
    "quantizable_nodes",
    "quantize_int8",
    "run",
    "runtime_runs",
    "torch_logits",
    "weight_invariants",
]
