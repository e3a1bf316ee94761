"""What a model file costs where it runs: `compress bench` and the measurements stages use.

- `grid`: `compress bench` as a library call (`bench(paths, data)` -> `BenchResult`);
- `variants`: model files (`.pt`, `.onnx`, `.ort`, shrink folders) turned into runnable
  variants per runtime and provider;
- `latency`: the one timing harness every runtime shares (interleaved runs, warm-up, threads),
  and the grid's cells;
- `benchreport`: the Markdown report and figures, drawn from the plain-data result;
- `ortprofile`: per-operator kernel time from ONNX Runtime's profiler;
- `envinfo`: the machine (CPU flags, threads, versions, GPU) beside every number;
- `layertime`, `speedup`: per-layer latency and the thinned-vs-unthinned speed-up that
  structured pruning (`compressor.channels`) decides and reports on.

onnxruntime is imported inside the functions that need it, as in the rest of `compressor`.
"""
