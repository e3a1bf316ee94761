"""Recurrent models through the default recipe: an LSTM and a GRU reading MNIST row by row
(28 steps of 28 pixels, the "sequential MNIST" task of Le et al. 2015, rows rather than
pixels), 128 hidden units. Their matrices are pruned 90% by default, like hidden fully
connected layers (Narang et al., "Exploring Sparsity in Recurrent Neural Networks", ICLR 2017;
Han et al., "ESE", FPGA 2017).

    python benchmarks/recurrent.py --data mnist:../shared/data/mnist --workdir W

Prints, per cell: weights, dense and shrunk test accuracy with the paired 95% interval, the
archive's bytes and ratio, what each recurrent matrix kept, the INT8 file's size against the
FP32 file's and the nodes that stay FP32. The models are importable as
`recurrent:RowRNN` with `benchmarks/` on the path (the script puts it there).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))


class RowRNN(nn.Module):
    """An LSTM, GRU or RNN over the image's rows, then a Linear head on the last step."""

    def __init__(self, in_shape=(1, 28, 28), num_classes=10, hidden=128, cell="LSTM"):
        super().__init__()
        self.rnn = getattr(nn, cell)(in_shape[-1], hidden, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x):  # (N, 1, rows, cols)
        h, _ = self.rnn(x[:, 0])
        return self.fc(h[:, -1])


def _cpu() -> str:
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        have = set(next(li for li in text.splitlines() if li.startswith("flags")).split())
        flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in have)
    except (OSError, StopIteration):
        pass
    return f"{platform.processor() or platform.machine()} ({flags})"


def main() -> None:
    import compresskit as ck

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="mnist:../shared/data/mnist")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--cells", default="LSTM,GRU")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    print(f"# {_cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# data {a.data}, {a.epochs} training epochs, default recipe, seed {a.seed}")
    rows = []
    for cell in a.cells.split(","):
        torch.manual_seed(a.seed)
        net = RowRNN(cell=cell)
        t = time.perf_counter()
        run = ck.train(net, a.data, ck.TrainConfig(epochs=a.epochs, seed=a.seed))
        trained = time.perf_counter() - t
        t = time.perf_counter()
        rep = ck.shrink(
            net,
            a.data,
            ck.Recipe(),
            out=a.workdir / cell.lower(),
            spec="recurrent:RowRNN",
            model_kwargs={"cell": cell},
            force=True,
        )
        shrunk = time.perf_counter() - t
        r = rep.report
        last = r["stages"][-1]
        lo, hi = last["change"]["ci_points"]
        kept = ", ".join(
            f"{row['layer']} {row['kept'] / row['weights']:.0%}"
            for row in r["layers"]
            if row["layer"].startswith("rnn.")
        )
        onnx = r.get("onnx", {})
        int8 = onnx.get("int8") or r.get("int8_not_written") or {}
        fp32_b = onnx.get("fp32", {}).get("bytes")
        int8_b = onnx.get("int8", {}).get("bytes")
        rows.append(
            f"| {cell} | {r['baseline']['parameters']:,} | {r['baseline']['test_accuracy']:.2%} | "
            f"{last['test_accuracy']:.2%} ({last['change']['points']:+.2f}, {lo:+.2f} to "
            f"{hi:+.2f}) | {r['archive']['bytes']:,} B, {r['archive']['ratio']:.1f}× | {kept} | "
            f"{fp32_b:,} / {f'{int8_b:,}' if int8_b else 'none'} B | "
            f"{int8.get('fp32_only_nodes')} | "
            f"{trained:.0f} / {shrunk:.0f} |"
        )
        del run
    print(
        "| cell | weights | dense test | shrunk test (Δ points, 95% CI) | archive | kept "
        "| FP32 / INT8 ONNX | FP32 in INT8 | train / shrink s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
