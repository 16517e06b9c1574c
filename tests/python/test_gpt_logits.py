"""The PyTorch logits round trip: a checkpoint of nn::GPT written by Kiln (tests/python/gpt_logits.cpp) loaded
into PyTorch through python/kiln_checkpoint.py (gpt_to_nanogpt's names, bench/gpt_torch_model.py's GPT) gives
the logits Kiln computed: f32 within 1e-5 relative to the logits' largest magnitude, bf16 autocast within
1e-2; and, where PyTorch is installed, the gradients of the mean cross-entropy within 1e-5 of each
parameter's largest. Without PyTorch (CI's CPU machine) the logits' reference is a numpy forward pass in
f64 of the same architecture (the gradients need PyTorch's autograd). Usage: test_gpt_logits.py REPOSITORY_ROOT KILN_GPT_LOGITS [cpu|cuda]"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

ROOT, PROGRAM = sys.argv[1], sys.argv[2]
DEVICE = sys.argv[3] if len(sys.argv) > 3 else "cpu"
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import kiln_checkpoint as kc  # noqa: E402

L, H, E, V, T = 2, 4, 64, 96, 32


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * w + b


def numpy_logits(sd, idx):
    """GPT-2's forward in f64: pre-LayerNorm blocks, causal softmax attention, tanh GELU, tied head."""
    p = {k: np.asarray(v, dtype=np.float64) for k, v in sd.items()}
    B, n = idx.shape
    x = p["wte.weight"][idx] + p["wpe.weight"][:n]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(L):
        g = lambda name: p[f"h.{i}.{name}"]  # noqa: E731
        qkv = layer_norm(x, g("ln_1.weight"), g("ln_1.bias")) @ g("attn.in_proj.weight").T + g("attn.in_proj.bias")
        q, k, v = (t.reshape(B, n, H, E // H).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(E // H) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        y = (a @ v).transpose(0, 2, 1, 3).reshape(B, n, E)
        x = x + y @ g("attn.out_proj.weight").T + g("attn.out_proj.bias")
        h = layer_norm(x, g("ln_2.weight"), g("ln_2.bias")) @ g("mlp.fc.weight").T + g("mlp.fc.bias")
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ g("mlp.proj.weight").T + g("mlp.proj.bias")
    return layer_norm(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["wte.weight"].T


def torch_model(sd, device):
    import torch
    from gpt_torch_model import GPT
    model = GPT(V, T, L, H, E).to(device).eval()
    nano = kc.gpt_to_nanogpt(sd)
    # bench/gpt_torch_model.py names its blocks' layers without nanoGPT's attn./mlp. prefixes
    names = {"attn.c_attn": "c_attn", "attn.c_proj": "c_proj", "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}
    state, kiln_name = {}, {}
    for (name, value), kiln in zip(nano.items(), list(sd.keys()) + ["wte.weight"]):
        name = name.replace("transformer.", "")
        for a, b in names.items():
            name = name.replace(a, b)
        state[name] = torch.as_tensor(np.asarray(value, dtype=np.float32))
        kiln_name[name] = kiln
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    return model, kiln_name


def torch_forward(model, x):
    h = model.wte(x) + model.wpe.weight[:x.size(1)]
    for block in model.h:
        h = block(h)
    return model.lm_head(model.ln_f(h))


def torch_logits(sd, idx, device, bf16):
    import torch
    model, _ = torch_model(sd, device)
    x = torch.as_tensor(idx, device=device)
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
        return torch_forward(model, x).float().cpu().numpy()


def torch_gradients(sd, idx, targets, device):
    """{Kiln name: gradient} of the mean cross-entropy, in f32."""
    import torch
    import torch.nn.functional as F
    model, kiln_name = torch_model(sd, device)
    x, y = torch.as_tensor(idx, device=device), torch.as_tensor(targets, device=device)
    logits = torch_forward(model, x)
    F.cross_entropy(logits.view(-1, V), y.view(-1)).backward()
    return {kiln_name[n]: p.grad.float().cpu().numpy() for n, p in model.named_parameters() if n in kiln_name}


def rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


class GptLogits(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kiln_gpt_logits_")
        subprocess.run([PROGRAM, cls.dir, DEVICE], check=True)  # 77 (no GPU) was handled below, at start
        cls.sd = kc.load_state_dict(os.path.join(cls.dir, "gpt.h5"), as_torch=False)
        cls.idx = np.fromfile(os.path.join(cls.dir, "tokens.i64"), dtype="<i8").reshape(3, T)
        cls.targets = np.fromfile(os.path.join(cls.dir, "targets.i64"), dtype="<i8").reshape(3, T)
        cls.kiln_f32 = np.fromfile(os.path.join(cls.dir, "logits_f32.f32"), dtype="<f4").reshape(3, T, V)
        try:
            import torch  # noqa: F401
            cls.torch = True
        except ImportError:
            cls.torch = False

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_f32_logits_match(self):
        want = numpy_logits(self.sd, self.idx)
        err = rel(self.kiln_f32.astype(np.float64), want)
        print(f"f32 logits on {DEVICE}: Kiln vs numpy f64 {err:.2e}")
        self.assertLess(err, 1e-5)
        if self.torch:
            got = torch_logits(self.sd, self.idx, DEVICE, bf16=False)
            err = rel(self.kiln_f32, got)
            print(f"f32 logits on {DEVICE}: Kiln vs PyTorch {err:.2e}")
            self.assertLess(err, 1e-5)

    def test_f32_gradients_match(self):
        names = list(self.sd.keys())
        for name in names:  # every parameter's gradient was written
            self.assertTrue(os.path.exists(os.path.join(self.dir, f"grad.{name}.f32")), name)
        if not self.torch:
            print("f32 gradients: PyTorch is not installed here; compared on the GPU machine")
            return
        want = torch_gradients(self.sd, self.idx, self.targets, DEVICE)
        self.assertEqual(sorted(want), sorted(names))
        worst = 0.0
        for name in names:
            got = np.fromfile(os.path.join(self.dir, f"grad.{name}.f32"), dtype="<f4").reshape(want[name].shape)
            err = rel(got, want[name])
            worst = max(worst, err)
            self.assertLess(err, 1e-5, name)
        print(f"f32 gradients on {DEVICE}: Kiln vs PyTorch, worst parameter {worst:.2e}")

    def test_bf16_logits_match(self):
        path = os.path.join(self.dir, "logits_bf16.f32")
        if DEVICE == "cpu":
            self.assertFalse(os.path.exists(path))  # bf16 autocast is the GPU's
            return
        kiln = np.fromfile(path, dtype="<f4").reshape(3, T, V)
        want = torch_logits(self.sd, self.idx, DEVICE, bf16=True) if self.torch else numpy_logits(self.sd, self.idx)
        err = rel(kiln, want)
        print(f"bf16 logits on {DEVICE}: Kiln vs {'PyTorch bf16' if self.torch else 'numpy f64'} {err:.2e}")
        self.assertLess(err, 1e-2)
        self.assertGreater(rel(kiln, self.kiln_f32), 0)  # it really ran in bf16


if __name__ == "__main__":
    if DEVICE == "cuda":  # no GPU here: a skip (ctest's SKIP_RETURN_CODE 77), as the other GPU tests
        probe = tempfile.mkdtemp(prefix="kiln_gpt_logits_probe_")
        status = subprocess.run([PROGRAM, probe, DEVICE], capture_output=True, text=True).returncode
        shutil.rmtree(probe, ignore_errors=True)
        if status == 77:
            print("SKIP: no CUDA device")
            sys.exit(77)
    unittest.main(argv=sys.argv[:1], verbosity=2)
