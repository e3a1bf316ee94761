"""ModelProto plumbing that keeps memory near one copy of a model's weights.

Python's protobuf (upb) frees a message's memory only with the whole message, so a model edited
in place keeps what it dropped (`compact`); a deep copy of a model to change its graph copies
every weight (`shell` copies the rest, `save_beside` writes the weights from the original,
one tensor at a time, as external data that ONNX Runtime maps instead of copying).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np


def subgraphs(node):
    """The graphs a node's attributes hold (If, Loop and Scan bodies)."""
    for a in node.attribute:
        if a.HasField("g"):
            yield a.g
        yield from a.graphs


def zero_point_types(graph, nodes) -> set[int]:
    """The element types (onnx.TensorProto codes) of the zero points that Q/DQ `nodes` of
    `graph` read from its initializers."""
    inits = {i.name: i.data_type for i in graph.initializer}
    return {inits[n.input[2]] for n in nodes if len(n.input) > 2 and n.input[2] in inits}


def compact(model):
    """`model` re-read from its own bytes. Python's protobuf (upb) allocates a message and all
    its parts in one arena that is freed only with the whole message: a model whose FP32
    weights were replaced (the quantizer's output is a deep copy of the FP32 model with its
    weights swapped for INT8 ones) keeps the dead FP32 weights alive. ResNet-18: each built
    INT8 model held 54 MiB where its bytes are 11 MiB; re-read, 11."""
    import onnx

    return onnx.load_from_string(model.SerializeToString())


SEQUENCE = "sequence"  # the symbolic sequence axis of a token model's input (`export_onnx`)
SEQUENCE_KEY = "sequence_length"  # metadata: the length it was trained on, the most it takes
# metadata for an app: how a raw sample becomes the input, and what the output means
INPUT_KEY = "compress.input"
OUTPUT_KEY = "compress.output"


def set_metadata(model, key: str, value: str) -> None:
    """Set `key` in the ModelProto's metadata_props (what ORT's `get_modelmeta()
    .custom_metadata_map` returns), replacing an earlier value."""
    keep_only(model.metadata_props, lambda p: p.key != key)
    model.metadata_props.add(key=key, value=value)


def metadata(model) -> dict[str, str]:
    """The ModelProto's metadata_props as a dict."""
    return {p.key: p.value for p in model.metadata_props}


def trained_length(meta: dict[str, str]) -> int | None:
    """The sequence length a token model's file was trained on, from its metadata (a
    ModelProto's `metadata`, or ORT's `get_modelmeta().custom_metadata_map`); None without."""
    value = meta.get(SEQUENCE_KEY, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def keep_only(repeated, keep) -> int:
    """Delete the elements of a repeated message field for which `keep(element)` is false, in
    place and in order; returns how many went. Why not `del field[:]` then `extend(kept)`:
    extend copies every kept element into the arena again and the old copies stay there until
    the whole message goes (upb). An EfficientNet-B0 fallback candidate, 15 MiB of bytes, held
    55 MiB live after three such passes over its initializers; deleted by index, 21."""
    gone = 0
    for i in range(len(repeated) - 1, -1, -1):
        if not keep(repeated[i]):
            del repeated[i]
            gone += 1
    return gone


def shell(ref):
    """A copy of the ModelProto `ref` but for its graph's initializers: every other field,
    whatever this onnx version defines, copied by reflection."""
    import onnx

    def fill(dst, src, skip: str = "") -> None:
        for fd, value in src.ListFields():
            if fd.name == skip:
                continue
            repeated = getattr(fd, "is_repeated", None)  # protobuf >= 6; `label` before
            if repeated if repeated is not None else fd.label == fd.LABEL_REPEATED:
                getattr(dst, fd.name).extend(value)
            elif fd.type == fd.TYPE_MESSAGE:
                getattr(dst, fd.name).CopyFrom(value)
            else:
                setattr(dst, fd.name, value)

    m = onnx.ModelProto()
    fill(m, ref, skip="graph")
    fill(m.graph, ref.graph, skip="initializer")
    return m


# External data offsets on the boundaries ORT maps at (4 KiB pages on Linux and macOS, 64 KiB
# on Windows); elsewhere it reads the weights into memory instead of mapping them
_PAGE = mmap.ALLOCATIONGRANULARITY
_SMALL = 1024  # elements: a tensor smaller than this stays inline (biases and the like)


def _elements(t) -> int:
    return int(np.prod(t.dims, dtype=np.int64)) if len(t.dims) else 1


def save_beside(m, initializers, path: Path, only: set[str] | None = None) -> list[str]:
    """Save `m` at `path` with `initializers` (another model's, left as they are) added as
    external data in a file beside it, written one tensor at a time; with `only`, just those
    named in it (the others inline). Returns the names written outside."""
    import onnx

    data = path.with_suffix(".data")
    inline_types = {onnx.TensorProto.STRING, onnx.TensorProto.INT32, onnx.TensorProto.INT64}
    outside: list[str] = []
    with open(data, "wb") as f:
        for t in initializers:
            if (
                t.data_type in inline_types
                or not t.HasField("raw_data")  # typed fields: no raw bytes to write as they are
                or _elements(t) < _SMALL
                or (only is not None and t.name not in only)
            ):
                # Small tensors and integer ones (shapes, axes) inline, copied: ORT's shape
                # inference at load refused a Reshape whose shape was external.
                m.graph.initializer.append(t)
                continue
            raw = t.raw_data
            f.write(b"\0" * (-f.tell() % _PAGE))
            stub = onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type)
            stub.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", f.tell()), ("length", len(raw))):
                stub.external_data.add(key=key, value=str(value))
            f.write(raw)
            m.graph.initializer.append(stub)
            outside.append(t.name)
    onnx.save(m, str(path))
    return outside
