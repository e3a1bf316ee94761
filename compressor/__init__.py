"""Deep Compression (Han, Mao & Dally, ICLR 2016), distillation (Hinton et al. 2015), INT8 ONNX
export and benchmarking: the stages behind `compress shrink` and `compress bench`.

Depends on `models` only; never on `distrib` (the CLI passes a training function in) or `cli`.
Heavy imports (onnx, onnxruntime) are made inside the functions that need them, so
`import compressor` stays fast.
"""
