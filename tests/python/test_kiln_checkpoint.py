"""python/kiln_checkpoint.py (h5py + numpy, no torch needed): reads a checkpoint Kiln wrote, bf16 bits both
ways (round to nearest even, as Kiln's core/half.h), save() then read_tensors() round trips every dtype with
the layout docs/checkpoint-format.md describes, the GPT and MultiheadAttention name mappings invert each
other. Run by ctest (python_interop) with the path of the repository as argv[1]."""
import os
import sys
import tempfile
import unittest

import h5py
import numpy as np

ROOT = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
import kiln_checkpoint as kc  # noqa: E402


class ReadsKilnFiles(unittest.TestCase):
    def test_a_checkpoint_written_by_kiln(self):
        path = os.path.join(ROOT, "tests", "optim", "checkpoint", "data", "v1_checkpoint.h5")
        tensors = kc.read_tensors(path)
        self.assertEqual(sorted(tensors), ["bias", "weight"])
        weight, dtype = tensors["weight"]
        self.assertEqual(dtype, "f32")
        self.assertEqual(weight.shape, (2, 3))
        with h5py.File(path) as f:
            np.testing.assert_array_equal(weight, f["model/weight"][()])
        sd = kc.load_state_dict(path, as_torch=False)
        np.testing.assert_array_equal(sd["bias"], tensors["bias"][0])
        # the optimizer's namespace too
        state = kc.read_tensors(path, namespace="optimizer/state")
        self.assertEqual(state["0/exp_avg"][0].shape, (2, 3))

    def test_not_a_kiln_file(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "plain.h5")
            with h5py.File(path, "w") as f:
                f["x"] = np.zeros(3)
            with self.assertRaises(ValueError):
                kc.read_tensors(path)


class Bf16(unittest.TestCase):
    def test_bits_both_ways(self):
        exact = np.array([0.0, 1.0, -2.5, 3.140625, 1e30, -1e-30], dtype=np.float32)
        np.testing.assert_array_equal(kc.bf16_to_f32(kc.f32_to_bf16(exact))[:4], exact[:4])
        self.assertEqual(kc.f32_to_bf16(np.float32(1.0))[()], 0x3F80)
        # halfway cases round to even: 1 + 2^-8 -> 1.0 (0x3F80), 1 + 3·2^-8 -> 1 + 2^-6 (0x3F82)
        self.assertEqual(kc.f32_to_bf16(np.float32(1 + 2 ** -8))[()], 0x3F80)
        self.assertEqual(kc.f32_to_bf16(np.float32(1 + 3 * 2 ** -8))[()], 0x3F82)
        self.assertTrue(np.isnan(kc.bf16_to_f32(kc.f32_to_bf16(np.float32("nan")))))


class Writes(unittest.TestCase):
    def test_save_then_read_every_dtype(self):
        rng = np.random.default_rng(0)
        sd = {
            "fc1.weight": rng.standard_normal((4, 3)).astype(np.float32),
            "fc1.bias": rng.standard_normal(4).astype(np.float64),
            "emb.weight": rng.standard_normal((5, 2)).astype(np.float16),
            "steps": np.array(7, dtype=np.int64),
            "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
            "mask": np.array([True, False, True]),
            "half": rng.standard_normal((2, 2)).astype(np.float32),
            "empty": np.zeros((0, 3), dtype=np.float32),
        }
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "out.h5")
            kc.save(path, sd, bf16={"half"}, metadata={"epoch": 3, "note": "from numpy"}, step=42)
            self.assertFalse(os.path.exists(path + ".tmp"))
            back = kc.read_tensors(path)
            for name, value in sd.items():
                array, dtype = back[name]
                if name == "half":
                    self.assertEqual(dtype, "bf16")
                    np.testing.assert_array_equal(array, kc.bf16_to_f32(kc.f32_to_bf16(value)))
                else:
                    self.assertEqual(array.dtype, value.dtype, name)
                    np.testing.assert_array_equal(array, value, name)
            with h5py.File(path) as f:  # the layout of docs/checkpoint-format.md
                self.assertEqual(int(f.attrs["kiln_format_version"]), 1)
                self.assertEqual(int(f.attrs["kiln_checkpoint_version"]), 2)
                self.assertEqual(int(f.attrs["step"]), 42)
                self.assertEqual(f["rng"].attrs["generator"], "philox4x32-10")
                self.assertEqual(int(f["metadata"].attrs["epoch"]), 3)
                w = f["model/fc1/weight"]
                self.assertEqual(w.attrs["name"], "model/fc1.weight")
                self.assertEqual(w.attrs["dtype"], "f32")
                self.assertTrue(w.fletcher32)
                self.assertEqual(f["model/mask"].dtype, np.uint8)
                self.assertEqual(f["model/half"].dtype, np.uint16)


class Float8(unittest.TestCase):
    def test_tables_follow_the_specification(self):
        self.assertEqual(kc.FP8_E4M3[0x7E], 448.0)
        self.assertEqual(kc.FP8_E4M3[0x38], 1.0)
        self.assertEqual(kc.FP8_E4M3[0x01], 2.0 ** -9)
        self.assertEqual(int(np.isnan(kc.FP8_E4M3).sum()), 2)
        self.assertEqual(kc.FP8_E5M2[0x7B], 57344.0)
        # E5M2 is the top byte of float16
        top = (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)
        same = (kc.FP8_E5M2 == top) | (np.isnan(kc.FP8_E5M2) & np.isnan(top))
        self.assertTrue(bool(same.all()))
        self.assertEqual(kc.fp8_to_f32(np.array([0x7E, 0xB8], dtype=np.uint8), "f8e4m3").tolist(), [448.0, -1.0])


class Names(unittest.TestCase):
    def test_gpt_and_nanogpt_invert_each_other(self):
        kiln = {"wte.weight": 1, "wpe.weight": 2, "ln_f.weight": 3, "ln_f.bias": 4}
        for part in ["ln_1.weight", "attn.in_proj.weight", "attn.in_proj.bias", "attn.out_proj.weight", "ln_2.bias",
                     "mlp.fc.weight", "mlp.proj.bias"]:
            kiln[f"h.0.{part}"] = part
            kiln[f"h.11.{part}"] = part
        nano = kc.gpt_to_nanogpt(kiln)
        self.assertEqual(nano["transformer.h.11.attn.c_attn.weight"], "attn.in_proj.weight")
        self.assertEqual(nano["transformer.h.0.mlp.c_proj.bias"], "mlp.proj.bias")
        self.assertEqual(nano["lm_head.weight"], 1)
        nano["transformer.h.0.attn.bias"] = "nanoGPT's causal mask buffer"
        self.assertEqual(kc.nanogpt_to_gpt(nano), kiln)
        with self.assertRaises(KeyError):
            kc.gpt_to_nanogpt({"head.weight": 0})

    def test_multihead_attention(self):
        kiln = {"attn.in_proj.weight": 1, "attn.in_proj.bias": 2, "attn.out_proj.weight": 3}
        torch_names = kc.mha_to_torch(kiln, "attn.")
        self.assertEqual(torch_names, {"attn.in_proj_weight": 1, "attn.in_proj_bias": 2, "attn.out_proj.weight": 3})
        self.assertEqual(kc.torch_to_mha(torch_names, "attn."), kiln)


if __name__ == "__main__":
    unittest.main()
