"""Kiln checkpoints in Python: read a Kiln HDF5 checkpoint (or archive) into a state_dict, and write a
state_dict as a Kiln checkpoint that optim::load_checkpoint(path, model) loads. Needs h5py and numpy;
torch is optional (tensors come back as torch tensors when it is installed and as_torch is true).

    import kiln_checkpoint as kc
    sd = kc.load_state_dict("run.h5")                       # Kiln names: "h.0.attn.in_proj.weight", ...
    model.load_state_dict(kc.gpt_to_nanogpt(sd))             # a nanoGPT-style GPT
    kc.save("from_torch.h5", kc.nanogpt_to_gpt(model.state_dict()))

The layout is docs/checkpoint-format.md's: datasets under /model, one group level per "." or "/" of the
name, each with its `dtype` (Kiln's name) and `name` attributes; bf16 is stored as its raw 16 bits.
"""
import os

import h5py
import numpy as np

FORMAT_VERSION = 1       # core/archive: kiln_format_version
CHECKPOINT_VERSION = 2   # optim/checkpoint.cpp: kiln_checkpoint_version
GENERATOR = "philox4x32-10"

_NUMPY = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "i32": np.int32, "i64": np.int64}


def bf16_to_f32(bits):
    """Raw bfloat16 bits (uint16) to float32: the bits are the top half of the float32."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """float32 to raw bfloat16 bits, rounding to nearest even (NaN stays NaN), as Kiln's core/half.h does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.ascontiguousarray(x, dtype=np.float32))
    return np.where(nan, ((u >> 16) | 0x0040).astype(np.uint16), rounded)


def _fp8_table(exponent_bits, mantissa_bits, ieee):
    """The float32 value of each of the 256 codes of an OCP FP8 format (core/float8.h)."""
    bias = (1 << (exponent_bits - 1)) - 1
    table = np.empty(256, dtype=np.float32)
    for c in range(256):
        s, e, m = c >> 7, (c >> mantissa_bits) & ((1 << exponent_bits) - 1), c & ((1 << mantissa_bits) - 1)
        top = (1 << exponent_bits) - 1
        if ieee and e == top:
            v = np.inf if m == 0 else np.nan
        elif not ieee and e == top and m == (1 << mantissa_bits) - 1:
            v = np.nan
        elif e == 0:
            v = m * 2.0 ** (1 - bias - mantissa_bits)
        else:
            v = (1 + m / (1 << mantissa_bits)) * 2.0 ** (e - bias)
        table[c] = -v if s else v
    return table


FP8_E4M3 = _fp8_table(4, 3, ieee=False)  # f8e4m3: no infinities, largest 448
FP8_E5M2 = _fp8_table(5, 2, ieee=True)   # f8e5m2: IEEE-like, largest 57344


def fp8_to_f32(bits, dtype):
    """Raw FP8 bits (uint8) of Kiln dtype f8e4m3 or f8e5m2 to float32."""
    return (FP8_E4M3 if dtype == "f8e4m3" else FP8_E5M2)[np.asarray(bits, dtype=np.uint8)]


def _decode(ds):
    dtype = ds.attrs["dtype"]
    dtype = dtype.decode() if isinstance(dtype, bytes) else str(dtype)
    raw = ds[()]
    if dtype == "bf16":
        return bf16_to_f32(raw), dtype
    if dtype == "bool":
        return np.asarray(raw) != 0, dtype
    if dtype in ("f8e4m3", "f8e5m2"):
        return fp8_to_f32(raw, dtype), dtype
    if dtype not in _NUMPY:
        raise ValueError(f"{ds.name}: unknown Kiln dtype '{dtype}'")
    return np.asarray(raw, dtype=_NUMPY[dtype]), dtype


def read_tensors(path, namespace="model"):
    """{name: (numpy array, Kiln dtype)} for every tensor saved under `namespace` (names without it)."""
    out = {}
    with h5py.File(path, "r") as f:
        version = f.attrs.get("kiln_format_version")
        if version is None:
            raise ValueError(f"{path}: not a Kiln archive (no kiln_format_version attribute)")
        if int(version) > FORMAT_VERSION:
            raise ValueError(f"{path}: format version {int(version)} is newer than this reader's {FORMAT_VERSION}")

        def visit(_, obj):
            if isinstance(obj, h5py.Dataset) and "name" in obj.attrs:
                name = obj.attrs["name"]
                name = name.decode() if isinstance(name, bytes) else str(name)
                if name.startswith(namespace + "/"):
                    out[name[len(namespace) + 1:]] = _decode(obj)

        f.visititems(visit)
    return out


def load_state_dict(path, as_torch=True, keep_bf16=True):
    """The model's tensors as a state_dict: torch tensors when torch is installed and as_torch (bf16 ones
    as torch.bfloat16 when keep_bf16, else float32), numpy arrays otherwise (bf16 decoded to float32)."""
    tensors = read_tensors(path)
    try:
        import torch  # noqa: F401
    except ImportError:
        as_torch = False
    if not as_torch:
        return {name: array for name, (array, _) in tensors.items()}
    import torch
    sd = {}
    for name, (array, dtype) in tensors.items():
        t = torch.from_numpy(np.ascontiguousarray(array))
        sd[name] = t.to(torch.bfloat16) if dtype == "bf16" and keep_bf16 else t
    return sd


def _to_numpy(value):
    """(numpy array, Kiln dtype) for a numpy array or a torch tensor."""
    if hasattr(value, "detach"):  # a torch tensor
        import torch
        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), "bf16"
        value = t.numpy()
    a = np.ascontiguousarray(value)
    for kiln, np_type in _NUMPY.items():
        if a.dtype == np_type:
            return a, kiln
    if a.dtype == np.bool_:
        return a.astype(np.uint8), "bool"
    raise ValueError(f"no Kiln dtype for numpy dtype {a.dtype}")


def save(path, state_dict, bf16=(), metadata=None, step=0, seed=0):
    """Writes `state_dict` ({name: numpy array or torch tensor}) as a Kiln checkpoint of a model alone, which
    optim::load_checkpoint(path, model) loads (with no optimizer or other component). Names in `bf16` are
    stored as bf16 whatever their dtype. metadata: {key: int, float or str}. Written to path.tmp, then renamed."""
    tmp = path + ".tmp"
    with h5py.File(tmp, "w", libver=("v110", "v110"), track_order=True) as f:
        f.attrs["kiln_format_version"] = np.int64(FORMAT_VERSION)
        f.attrs["kiln_checkpoint_version"] = np.int64(CHECKPOINT_VERSION)
        f.attrs["step"] = np.int64(step)
        rng = f.create_group("rng", track_order=True)
        rng.attrs["generator"] = GENERATOR
        rng.attrs["seed"] = np.int64(seed)
        rng.attrs["offset"] = np.int64(0)
        if metadata:
            meta = f.create_group("metadata", track_order=True)
            for key, value in metadata.items():
                meta.attrs[key] = np.int64(value) if isinstance(value, (bool, int, np.integer)) else value
        for name, value in state_dict.items():
            array, dtype = _to_numpy(value)
            if name in bf16 and dtype != "bf16":
                array, dtype = f32_to_bf16(array.astype(np.float32)), "bf16"
            parts = ["model"] + name.replace("/", ".").split(".")
            group = f
            for part in parts[:-1]:
                group = group.require_group(part) if part in group else group.create_group(part, track_order=True)
            big = array.ndim > 0 and array.size > 0
            ds = group.create_dataset(parts[-1], data=array, chunks=True if big else None, fletcher32=big)
            ds.attrs["dtype"] = dtype
            ds.attrs["name"] = "model/" + name
    os.replace(tmp, path)


# ---- name mappings ----

_GPT_BLOCK = [("ln_1", "ln_1"), ("attn.in_proj", "attn.c_attn"), ("attn.out_proj", "attn.c_proj"), ("ln_2", "ln_2"),
              ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]


def gpt_to_nanogpt(sd):
    """nn::GPT's names to a nanoGPT-style module's (transformer.wte, transformer.h.<i>.attn.c_attn, ...,
    lm_head tied to wte). The fused qkv projection keeps its (3E, E) layout, q, k, v in that order."""
    out = {}
    for name, value in sd.items():
        new = None
        if name.startswith("h."):
            i, rest = name[2:].split(".", 1)
            for kiln, nano in _GPT_BLOCK:
                if rest.startswith(kiln + "."):
                    new = f"transformer.h.{i}.{nano}{rest[len(kiln):]}"
        elif name.split(".")[0] in ("wte", "wpe", "ln_f"):
            new = "transformer." + name
        if new is None:
            raise KeyError(f"gpt_to_nanogpt: no nanoGPT name for '{name}'")
        out[new] = value
    if "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]  # tied
    return out


def nanogpt_to_gpt(sd):
    """The inverse of gpt_to_nanogpt (lm_head.weight dropped: nn::GPT ties it to wte)."""
    out = {}
    for name, value in sd.items():
        if name == "lm_head.weight" or name.endswith(".attn.bias") and name.startswith("transformer.h."):
            continue  # the tied head, and nanoGPT's causal-mask buffer
        if not name.startswith("transformer."):
            raise KeyError(f"nanogpt_to_gpt: unexpected name '{name}'")
        rest = name[len("transformer."):]
        if rest.startswith("h."):
            i, tail = rest[2:].split(".", 1)
            for kiln, nano in _GPT_BLOCK:
                if tail.startswith(nano + "."):
                    rest = f"h.{i}.{kiln}{tail[len(nano):]}"
                    break
            else:
                raise KeyError(f"nanogpt_to_gpt: no Kiln name for '{name}'")
        out[rest] = value
    return out


def mha_to_torch(sd, prefix=""):
    """nn::MultiheadAttention's names under `prefix` (in_proj.weight, in_proj.bias, out_proj.*) to
    torch.nn.MultiheadAttention's (in_proj_weight, in_proj_bias, out_proj.*); other names unchanged."""
    rename = {prefix + "in_proj.weight": prefix + "in_proj_weight", prefix + "in_proj.bias": prefix + "in_proj_bias"}
    return {rename.get(name, name): value for name, value in sd.items()}


def torch_to_mha(sd, prefix=""):
    """The inverse of mha_to_torch."""
    rename = {prefix + "in_proj_weight": prefix + "in_proj.weight", prefix + "in_proj_bias": prefix + "in_proj.bias"}
    return {rename.get(name, name): value for name, value in sd.items()}
