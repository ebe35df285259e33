"""Kimi Delta Attention goldens from fla-core's naive (pure torch) KDA reference.

Writes ``kda_naive.npz``. Each case stores float32 inputs and the outputs of
``naive_recurrent_kda`` (``o``, ``final_state``) and, where the sequence splits into whole chunks,
of ``naive_chunk_kda`` (``o_chunk``, ``final_state_chunk``). The first case uses the bare names
(``q``, ``k``, ``v``, ``g``, ``beta``, ``initial_state``, ``scale``, ``o``, ...); the others prefix
them with ``<case>_``. ``metadata`` is a JSON string (a numpy unicode scalar, so no pickle is
needed) that spells out every call: argument names, layouts, the recurrence, scale, which inputs
were normalised, and how far the chunked form is from the recurrent one.

fla's package ``__init__`` imports triton, so ``fla/ops/kda/naive.py`` is loaded by file path; it
needs only torch and einops. It computes in float32 whatever the input dtype.
"""

import importlib.metadata
import importlib.util
import json
import pathlib
from types import ModuleType

import numpy as np
import torch

SEED = 1234
MAX_FILE_BYTES = 1 << 20
DEEP_DECAY = -20.0
DEEP_DECAY_FRACTION = 0.05

CASES = (
    # name, B, T, H, HV, K, V, scale (None: the default K**-0.5), chunk_size, initial state
    ("", 2, 70, 2, 2, 32, 32, None, 14, True),
    ("gva", 1, 128, 2, 4, 32, 16, 0.1, 64, False),
    ("decode", 3, 1, 2, 2, 32, 32, None, None, True),
)

LAYOUT = {
    "q": "[B, T, H, K] float32, L2-normalised over K before the call (the function does not)",
    "k": "[B, T, H, K] float32, L2-normalised over K before the call (the function does not)",
    "v": "[B, T, HV, V] float32",
    "g": "[B, T, HV, K] float32, log-space decay per key dim (<= 0), one per value head",
    "beta": "[B, T, HV] float32 in (0, 1)",
    "initial_state": "[B, HV, K, V] float32 (zeros, and None passed, when initial_state_passed "
    "is false)",
    "scale": "float32 scalar, passed explicitly (equal to K**-0.5, fla's default, unless noted)",
    "o": "[B, T, HV, V] float32",
    "final_state": "[B, HV, K, V] float32 (output_final_state=True)",
}

RECURRENCE = (
    "G = HV // H; value head j reads q/k head j // G (repeat_interleave). Per step t, per value "
    "head: S = S * exp(g_t)[:, None]; S = S + beta_t * outer(k_t, v_t - k_t @ S); "
    "o_t = (scale * q_t) @ S. S starts at initial_state (or zeros), has layout [K, V]."
)


def load_naive() -> ModuleType:
    """fla/ops/kda/naive.py as a module, without running fla's package __init__."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("fla-core is not installed: pip install fla-core")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _inputs(generator: torch.Generator, b: int, t: int, h: int, hv: int, k: int, v: int) -> dict:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    g = -torch.nn.functional.softplus(randn(b, t, hv, k) - 1.0)
    deep = torch.rand((b, t, hv, k), generator=generator) < DEEP_DECAY_FRACTION
    g = torch.where(deep, DEEP_DECAY * torch.rand((b, t, hv, k), generator=generator), g)
    g.view(-1)[0] = DEEP_DECAY
    return {
        "q": torch.nn.functional.normalize(randn(b, t, h, k), dim=-1),
        "k": torch.nn.functional.normalize(randn(b, t, h, k), dim=-1),
        "v": randn(b, t, hv, v),
        "g": g,
        "beta": torch.sigmoid(randn(b, t, hv)),
        "initial_state": 0.5 * randn(b, hv, k, v),
    }


def _run_case(naive: ModuleType, generator: torch.Generator, case: tuple) -> tuple[dict, dict]:
    name, b, t, h, hv, k, v, scale, chunk_size, with_state = case
    inputs = _inputs(generator, b, t, h, hv, k, v)
    if not with_state:
        inputs["initial_state"] = torch.zeros_like(inputs["initial_state"])
    scale = k**-0.5 if scale is None else scale
    call = {
        "q": inputs["q"],
        "k": inputs["k"],
        "v": inputs["v"],
        "g": inputs["g"],
        "beta": inputs["beta"],
        "scale": scale,
        "initial_state": inputs["initial_state"] if with_state else None,
        "output_final_state": True,
    }
    arrays = {key: value.numpy() for key, value in inputs.items()}
    arrays["scale"] = np.float32(scale)
    o, final_state = naive.naive_recurrent_kda(**call)
    arrays["o"], arrays["final_state"] = o.numpy(), final_state.numpy()
    meta = {
        "prefix": f"{name}_" if name else "",
        "shape": {"B": b, "T": t, "H": h, "HV": hv, "K": k, "V": v},
        "scale": scale,
        "initial_state_passed": with_state,
        "outputs": {"o, final_state": "naive_recurrent_kda(q, k, v, g, beta, scale=scale, "
                    "initial_state=..., output_final_state=True)"},
    }
    if chunk_size is not None:
        o_chunk, state_chunk = naive.naive_chunk_kda(**call, chunk_size=chunk_size)
        arrays["o_chunk"], arrays["final_state_chunk"] = o_chunk.numpy(), state_chunk.numpy()
        meta["outputs"]["o_chunk, final_state_chunk"] = (
            f"naive_chunk_kda(same arguments, chunk_size={chunk_size})"
        )
        meta["chunk_size"] = chunk_size
        meta["max_abs_diff_chunk_vs_recurrent"] = {
            "o": float((o_chunk - o).abs().max()),
            "final_state": float((state_chunk - final_state).abs().max()),
        }
    prefix = meta["prefix"]
    return {f"{prefix}{key}": value.astype(np.float32) for key, value in arrays.items()}, meta


def write(golden_dir: pathlib.Path) -> None:
    naive = load_naive()
    generator = torch.Generator().manual_seed(SEED)
    arrays, cases = {}, {}
    for case in CASES:
        case_arrays, case_meta = _run_case(naive, generator, case)
        arrays.update(case_arrays)
        cases[case[0] or "main"] = case_meta
    metadata = {
        "source": "fla-core fla/ops/kda/naive.py",
        "versions": {name: importlib.metadata.version(name) for name in ("fla-core", "torch")},
        "compute_dtype": "float32",
        "layout": LAYOUT,
        "recurrence": RECURRENCE,
        "g_distribution": f"-softplus(N(0,1) - 1), with {DEEP_DECAY_FRACTION:.0%} of entries "
        f"uniform in ({DEEP_DECAY}, 0) and the first entry exactly {DEEP_DECAY}",
        "cases": cases,
    }
    arrays["metadata"] = np.array(json.dumps(metadata, indent=1))
    path = golden_dir / "kda_naive.npz"
    np.savez(path, **arrays)
    check(path)


def check(path: pathlib.Path) -> None:
    """Shapes against the metadata, finite values, file size, chunked close to recurrent."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{path} holds {size} bytes, over {MAX_FILE_BYTES=}")
    with np.load(path, allow_pickle=False) as data:
        metadata = json.loads(str(data["metadata"]))
        for name, meta in metadata["cases"].items():
            s, prefix = meta["shape"], meta["prefix"]
            expected = {
                "q": (s["B"], s["T"], s["H"], s["K"]),
                "k": (s["B"], s["T"], s["H"], s["K"]),
                "v": (s["B"], s["T"], s["HV"], s["V"]),
                "g": (s["B"], s["T"], s["HV"], s["K"]),
                "beta": (s["B"], s["T"], s["HV"]),
                "initial_state": (s["B"], s["HV"], s["K"], s["V"]),
                "scale": (),
                "o": (s["B"], s["T"], s["HV"], s["V"]),
                "final_state": (s["B"], s["HV"], s["K"], s["V"]),
            }
            if "chunk_size" in meta:
                expected["o_chunk"] = expected["o"]
                expected["final_state_chunk"] = expected["final_state"]
            for key, shape in expected.items():
                array = data[f"{prefix}{key}"]
                if array.shape != shape or array.dtype != np.float32:
                    raise ValueError(f"{name} {key}: {array.shape} {array.dtype}, want {shape}")
                if not np.isfinite(array).all():
                    raise ValueError(f"{name} {key} has non-finite values")
            diffs = meta.get("max_abs_diff_chunk_vs_recurrent", {})
            if any(diff > 1e-3 for diff in diffs.values()):
                raise ValueError(f"{name}: chunked and recurrent KDA disagree: {diffs}")
            o = data[f"{prefix}o"]
            print(f"kda {name}: {s}, |o| max {np.abs(o).max():.3f}, chunk diffs {diffs}")
    print(f"{path.name}: {size} bytes")
