"""Fused element-wise kernels (daskpty.physics.kernels).

CPU: every kernel's NumPy path (the reference, what runs on the CPU) against the straightforward
unfused NumPy expression, or a 1-D minimisation / finite differences where that is the ground
truth. GPU (skipped without CuPy and a device): the fused CuPy path against the NumPy reference
on the same data, to float32 tolerance.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from daskpty.physics import kernels

from gpu_device import cupy_or_skip as _cupy

SHAPES = [(3, 1, 8, 8), (4, 2, 16, 16), (2, 3, 12, 10)]  # (B, M, ny, nx), modes > 1 included


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _complex(rng, shape, dtype=np.complex64):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def _case(shape, seed=0, masked=True, background=None):
    """Far fields, Poisson counts near the model, a mask and an optional background."""
    rng = np.random.default_rng(seed)
    far = _complex(rng, shape) * np.float32(3.0)
    b, _, ny, nx = shape
    yhat = (np.abs(far) ** 2).sum(axis=1)
    y = rng.poisson(yhat * rng.uniform(0.5, 1.5, yhat.shape)).astype(np.float32)
    valid = None
    if masked:
        valid = np.ones((ny, nx), bool)
        valid[0, :3] = False
        valid[ny // 2, nx // 2] = False
    bg = None
    if background == "scalar":
        bg = np.full((1, 1), 0.7, np.float32)
    elif background == "pixel":
        bg = rng.uniform(0.0, 1.0, (ny, nx)).astype(np.float32)
    return far, y, valid, bg


def _model(far, bg):
    yhat = (far.real.astype(np.float64) ** 2 + far.imag.astype(np.float64) ** 2).sum(axis=1)
    return yhat if bg is None else yhat + bg


def _mask(valid, shape):
    return np.ones(shape[-2:]) if valid is None else valid.astype(np.float64)


def _poisson_terms(model, y, eps):
    """The Poisson loss per pixel, ŷ − y − y log((ŷ+ε)/y), with y log y taken as 0 below one count."""
    y = np.asarray(y, np.float64)
    return model - y - y * (np.log(model + eps) - np.log(np.maximum(y, 1.0)))


def _alpha_by_minimisation(yhat, y, valid, eps):
    """Ground truth α_j: minimise the Poisson NLL along Ψ(1 − α g) by a bounded 1-D search."""
    m = _mask(valid, yhat.shape)
    g = 1.0 - y / (yhat + eps)
    out = []
    for j in range(yhat.shape[0]):
        def nll(a, j=j):
            model = yhat[j] * np.maximum(1.0 - a * g[j], 1e-6) ** 2
            return float((m * (model - y[j] * np.log(model))).sum())
        out.append(minimize_scalar(nll, bounds=(0.0, 1.0), method="bounded",
                                   options={"xatol": 1e-10}).x)
    return np.array(out)


@pytest.fixture
def fused_restored():
    before = kernels.fused_enabled()
    yield
    kernels.set_fused(before)


# --------------------------------------------------------------------------------------------------
# NumPy paths against the unfused expressions


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("background", [None, "scalar", "pixel"])
def test_mode_intensity(shape, background):
    far, _, _, bg = _case(shape, background=background)
    got = kernels.mode_intensity(far.copy(), bg)
    assert got.shape == (shape[0],) + shape[2:] and got.dtype == np.float32
    assert _rel(got, _model(far, bg)) < 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("background", [None, "pixel"])
def test_gaussian_far_field_update(shape, masked, background):
    far, y, valid, bg = _case(shape, seed=1, masked=masked, background=background)
    eps = 1e-6
    delta, yhat, loss = kernels.far_field_update("gaussian", far.copy(), y, valid, eps, background=bg)
    model = _model(far, bg)
    m = _mask(valid, y.shape)
    factor = np.where(m > 0, np.sqrt(y) / np.sqrt(model + eps), 1.0)
    expected = far * factor[:, None] - far
    assert _rel(delta, expected) < 1e-5
    assert _rel(yhat, model) < 1e-6
    expected_loss = (m * (np.sqrt(y) - np.sqrt(model + eps)) ** 2).sum(axis=(1, 2))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def test_far_field_update_overwrite_writes_in_place():
    far, y, valid, _ = _case(SHAPES[1], seed=2)
    buf = far.copy()
    delta, _, _ = kernels.far_field_update("gaussian", buf, y, valid, overwrite=True)
    assert np.shares_memory(delta, buf)
    fresh, _, _ = kernels.far_field_update("gaussian", far.copy(), y, valid)
    np.testing.assert_array_equal(buf, fresh)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("background", [None, "scalar"])
def test_poisson_far_field_update(shape, masked, background):
    far, y, valid, bg = _case(shape, seed=3, masked=masked, background=background)
    eps = 1e-6
    delta, yhat, loss = kernels.far_field_update("poisson", far.copy(), y, valid, eps, background=bg)
    model = _model(far, bg)
    m = _mask(valid, y.shape)
    alpha = _alpha_by_minimisation(model, y, valid, eps)
    expected = far * (-alpha[:, None, None] * (1.0 - y / (model + eps)) * m)[:, None]
    assert _rel(delta, expected) < 2e-4
    assert _rel(yhat, model) < 1e-6
    expected_loss = (m * _poisson_terms(model, y, eps)).sum(axis=(1, 2))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_poisson_alpha_and_loss(shape):
    far, y, valid, _ = _case(shape, seed=4)
    yhat = kernels.mode_intensity(far)
    eps = 1e-6
    alpha = kernels.poisson_alpha(yhat, y, valid, eps)
    np.testing.assert_allclose(alpha, _alpha_by_minimisation(yhat.astype(np.float64), y, valid, eps),
                               atol=2e-4)
    m = _mask(valid, y.shape)
    np.testing.assert_allclose(kernels.poisson_loss(yhat, y, valid, eps),
                               (m * _poisson_terms(yhat.astype(np.float64), y, eps)).sum(axis=(1, 2)),
                               rtol=1e-7)


def _ad_loss_expected(name, far, y, valid, eps, bg):
    model = _model(far, bg)
    m = _mask(valid, y.shape)
    if name == "gaussian":
        value = m * (np.sqrt(model + eps) - np.sqrt(y)) ** 2
        factor = 2.0 * (1.0 - np.sqrt(y / (model + eps))) * m
    elif name == "poisson":
        value = m * _poisson_terms(model, y, eps)
        factor = 2.0 * (1.0 - y / (model + eps)) * m
    else:
        value = m * (model - y) ** 2
        factor = 4.0 * (model - y) * m
    return value.sum(axis=(1, 2)), far * factor[:, None], model


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", kernels.LOSS_NAMES)
@pytest.mark.parametrize("background", [None, "pixel"])
def test_far_field_loss(shape, name, background):
    far, y, valid, bg = _case(shape, seed=5, background=background)
    eps = 1e-6
    value, grad, yhat = kernels.far_field_loss(name, far.copy(), y, valid, eps, gradient=True, background=bg)
    ev, eg, em = _ad_loss_expected(name, far, y, valid, eps, bg)
    np.testing.assert_allclose(value, ev, rtol=2e-5)
    assert _rel(grad, eg) < 1e-5
    assert _rel(yhat, em) < 1e-6
    value2, none, _ = kernels.far_field_loss(name, far.copy(), y, valid, eps, gradient=False, background=bg)
    assert none is None
    np.testing.assert_allclose(value2, value, rtol=1e-12)


@pytest.mark.parametrize("name", kernels.LOSS_NAMES)
def test_far_field_loss_gradient_by_finite_differences(name):
    """dL/dt of L(Ψ + t V) at t = 0 equals Re⟨∇_Ψ L, V⟩ (complex128 for a clean difference)."""
    far, y, valid, _ = _case((2, 2, 8, 8), seed=6)
    far = far.astype(np.complex128)
    rng = np.random.default_rng(7)
    v = _complex(rng, far.shape, np.complex128)
    eps = 1e-6
    _, grad, _ = kernels.far_field_loss(name, far.copy(), y, valid, eps, gradient=True)
    t = 1e-6
    plus = kernels.far_field_loss(name, far + t * v, y, valid, eps, gradient=False)[0].sum()
    minus = kernels.far_field_loss(name, far - t * v, y, valid, eps, gradient=False)[0].sum()
    numeric = (plus - minus) / (2 * t)
    analytic = float(np.vdot(grad, v).real)
    assert numeric == pytest.approx(analytic, rel=1e-5)


def test_far_field_loss_rejects_unknown_names():
    far, y, valid, _ = _case(SHAPES[0])
    with pytest.raises(ValueError, match="loss must be one of"):
        kernels.far_field_loss("huber", far, y, valid, 1e-6, gradient=True)
    with pytest.raises(ValueError, match="noise must be one of"):
        kernels.far_field_update("huber", far, y, valid)


@pytest.mark.parametrize("shape", SHAPES)
def test_object_gradient(shape):
    rng = np.random.default_rng(8)
    sp, chi = _complex(rng, shape), _complex(rng, shape)
    g, w = kernels.object_gradient(sp.copy(), chi)
    assert _rel(g, (np.conj(sp) * chi).sum(axis=1)) < 1e-6
    assert _rel(w, (np.abs(sp.astype(np.complex128)) ** 2).sum(axis=1)) < 1e-6
    out = np.empty(g.shape, np.complex64)
    g2, _ = kernels.object_gradient(sp.copy(), chi, out=out)
    assert g2 is out and np.array_equal(g2, g)
    buf = sp.copy()
    g3, w3 = kernels.object_gradient(buf, chi, overwrite=True)  # g in the first mode's buffer
    assert np.shares_memory(g3, buf) and np.array_equal(g3, g) and np.array_equal(w3, w)


@pytest.mark.parametrize("shape", SHAPES)
def test_conj_product(shape):
    rng = np.random.default_rng(9)
    a, b = _complex(rng, shape), _complex(rng, (shape[0],) + shape[2:])
    expected = a * np.conj(b)[:, None]
    assert _rel(kernels.conj_product(a, b.copy()), expected) < 1e-7
    buf = a.copy()
    assert kernels.conj_product(buf, b.copy(), out=buf) is buf
    assert _rel(buf, expected) < 1e-7


@pytest.mark.parametrize("shape", SHAPES)
def test_step_dots(shape):
    rng = np.random.default_rng(10)
    d = _complex(rng, (shape[0],) + shape[2:])
    sp, bb, chi = _complex(rng, shape), _complex(rng, shape), _complex(rng, shape)
    got = kernels.step_dots(d, sp, bb, chi)
    a = (d[:, None] * sp).astype(np.complex128)
    b, c = bb.astype(np.complex128), chi.astype(np.complex128)
    expected = [[np.vdot(x[j], z[j]).real for j in range(shape[0])]
                for x, z in ((a, c), (b, c), (a, a), (b, b), (a, b))]
    for g, e in zip(got, expected):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * max(abs(v) for v in e))


@pytest.mark.parametrize("shape", SHAPES)
def test_object_step_dots(shape):
    rng = np.random.default_rng(11)
    d, g = _complex(rng, (shape[0],) + shape[2:]), _complex(rng, (shape[0],) + shape[2:])
    w = rng.uniform(0.0, 2.0, g.shape).astype(np.float32)
    a_chi, a_a = kernels.object_step_dots(d, g, w)
    np.testing.assert_allclose(a_chi, [np.vdot(d[j], g[j]).real for j in range(shape[0])], rtol=1e-5)
    np.testing.assert_allclose(a_a, [(np.abs(d[j]) ** 2 * w[j]).sum() for j in range(shape[0])], rtol=1e-5)


def test_switch_and_numpy_arrays_never_fuse(fused_restored):
    far = np.zeros((1, 1, 4, 4), np.complex64)
    kernels.set_fused(True)
    assert kernels.fused_enabled() and not kernels.uses_fused(far)
    kernels.set_fused(False)
    assert not kernels.fused_enabled()


def test_environment_variable_turns_fusion_off():
    code = "import daskpty.physics.kernels as k; print(k.fused_enabled())"
    env = {**os.environ, "DASKPTY_FUSED_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------
# The fused branches' calls, on the CPU: a stand-in CuPy whose kernel classes check every call
# against the declared parameters (count, dtypes, contiguous raw arrays, broadcast shapes, the
# reduction axes) and return outputs of the declared shapes. It checks the plumbing, not numbers.


class _DeviceArray(np.ndarray):
    pass


_DeviceArray.__module__ = "cupy"
_DTYPES = {"float32": np.float32, "float64": np.float64, "complex64": np.complex64,
           "complex128": np.complex128, "int32": np.int32, "int64": np.int64}


def _params(text):
    out = []
    for p in text.split(","):
        words = p.split()
        raw = words[0] == "raw"
        words = words[raw:]
        out.append((raw, _DTYPES[words[0]], words[1]))
    return out


def _checked_shape(name, params, args):
    assert len(args) == len(params), (name, len(args), len(params))
    shapes = []
    for (raw, dtype, pname), a in zip(params, args):
        if isinstance(a, np.ndarray):
            assert type(a) is _DeviceArray and a.dtype == dtype, (name, pname, type(a), a.dtype)
            if raw:
                assert a.flags.c_contiguous, (name, pname)
            else:
                shapes.append(a.shape)
        else:
            assert np.asarray(a).dtype == dtype, (name, pname, type(a))
    return np.broadcast_shapes(*shapes)


class _Elementwise:
    def __init__(self, in_params, out_params, operation, name, **kwargs):
        self.ins, self.outs, self.name = _params(in_params), _params(out_params), name

    def __call__(self, *args):
        _CALLED.add(self.name)
        shape = _checked_shape(self.name, self.ins + self.outs, args)
        outs = args[len(self.ins):]
        assert all(o.shape == shape for (raw, _, _), o in zip(self.outs, outs) if not raw), self.name
        return outs if len(outs) > 1 else outs[0]


class _Reduction:
    def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name, **kwargs):
        self.ins, self.out, self.name = _params(in_params), _params(out_params)[0][1], name

    def __call__(self, *args, axis):
        _CALLED.add(self.name)
        shape = _checked_shape(self.name, self.ins, args)
        return np.zeros([s for i, s in enumerate(shape) if i not in axis], self.out).view(_DeviceArray)


_CALLED: set = set()


@pytest.fixture
def checking_cupy(monkeypatch, fused_restored):
    import types

    cp = types.ModuleType("cupy")
    for name in ("clip", "maximum", "float32", "complex64"):
        setattr(cp, name, getattr(np, name))
    for name in ("asarray", "ascontiguousarray", "empty", "zeros", "ones", "full"):
        setattr(cp, name, (lambda f: lambda *a, **k: f(*a, **k).view(_DeviceArray))(getattr(np, name)))
    cp.ElementwiseKernel, cp.ReductionKernel = _Elementwise, _Reduction
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(kernels, "_KERNELS", {})
    kernels.set_fused(True)
    _CALLED.clear()
    yield lambda a: np.ascontiguousarray(a).view(_DeviceArray)
    text = open(kernels.__file__).read()
    import re
    built = re.findall(r'"(daskpty_\w+)"', text)
    assert _CALLED == set(built), set(built) - _CALLED  # every kernel was called


@pytest.mark.parametrize("modes", [1, 3])
def test_fused_calls_match_the_kernels_parameters(checking_cupy, modes):
    dev = checking_cupy
    b, ny, nx = 3, 8, 6
    far, y, valid, bg = _case((b, modes, ny, nx), seed=16, background="pixel")
    pattern = (b, ny, nx)
    assert kernels.uses_fused(dev(far)) and not kernels.uses_fused(far)
    for background in (None, dev(bg), dev(bg[:1, :1])):
        for mask in (None, dev(valid)):
            for noise in ("gaussian", "poisson"):
                buf = dev(far)
                delta, yhat, loss = kernels.far_field_update(noise, buf, dev(y), mask, overwrite=True,
                                                             background=background)
                assert delta is buf and yhat.shape == pattern and loss.shape == (b,)
            for name in kernels.LOSS_NAMES:
                value, grad, yhat = kernels.far_field_loss(name, dev(far), dev(y), mask, 1e-6, True,
                                                           background=background)
                assert value.shape == (b,) and grad.shape == far.shape and yhat.shape == pattern
                assert kernels.far_field_loss(name, dev(far), dev(y), mask, 1e-6, False)[1] is None
    strided = dev(np.concatenate([far, far], axis=-1))[..., ::2]  # overwrite a non-contiguous far
    assert kernels.far_field_update("gaussian", strided, dev(y), None, overwrite=True)[0] is strided
    assert kernels.far_field_loss("poisson", strided, dev(y), None, 1e-6, True, overwrite=True)[1] is strided
    assert kernels.mode_intensity(dev(far), dev(bg)).shape == pattern
    assert kernels.poisson_alpha(dev(y), dev(y), dev(valid)).shape == (b,)
    sp, d = dev(far), dev(far[:, 0])
    g, w = kernels.object_gradient(sp, sp)
    assert g.shape == pattern and g.dtype == np.complex64 and w.dtype == np.float32
    assert kernels.conj_product(sp, d, out=sp) is sp
    assert all(s.shape == (b,) for s in kernels.step_dots(d, sp, sp, sp))
    assert all(s.shape == (b,) for s in kernels.object_step_dots(d, g, w))


# --------------------------------------------------------------------------------------------------
# The CUDA sources compile (NVRTC through CuPy's bindings and its bundled headers; no GPU needed,
# skipped without CuPy). Each kernel is assembled in the shape CuPy generates — const CArray inputs,
# non-raw arguments bound by reference per index, reductions through REDUCE/POST_MAP — an
# approximation of CuPy's code generator that catches C++ errors such as writing to an input.
# Without a GPU: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12 in a throwaway venv, then
# LD_LIBRARY_PATH=<venv>/lib/python3.X/site-packages/nvidia/cuda_nvrtc/lib PYTHONPATH=.:tests \
#   <venv>/bin/python -m pytest --noconftest tests/test_kernels.py -k nvrtc

_SCALARS = {"modes", "npix", "has_bg", "bg_full", "has_mask", "eps", "kind", "write", "per_item"}
_CTYPES = {"float32": "float", "float64": "double", "complex64": "complex<float>",
           "complex128": "complex<double>", "int32": "int", "int64": "long long"}


def _nvrtc_compiler():
    cupy = pytest.importorskip("cupy")
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        pytest.skip("no NVRTC bindings in this CuPy")
    root = os.path.join(os.path.dirname(cupy.__file__), "_core", "include")
    if not os.path.isdir(os.path.join(root, "cupy", "_cccl")):
        pytest.skip("this CuPy does not bundle the CCCL headers")
    options = tuple("-I" + d for d in [root] + [os.path.join(root, "cupy", "_cccl", x)
                                                for x in ("libcudacxx", "thrust", "cub")])
    options += ("--std=c++17", "-arch=compute_80")

    def compile_source(src):
        prog = nvrtc.createProgram(src, "kernel.cu", (), ())
        try:
            nvrtc.compileProgram(prog, options)
            return ""
        except Exception as exc:
            return nvrtc.getProgramLog(prog) or str(exc)
        finally:
            nvrtc.destroyProgram(prog)

    try:
        error = compile_source('extern "C" __global__ void k() {}')
    except Exception as exc:  # the NVRTC library itself is missing
        pytest.skip(f"NVRTC not loadable: {exc}")
    if error:
        pytest.skip(f"NVRTC does not compile an empty kernel here: {error[:200]}")
    return compile_source


class _Recorded:
    def __init__(self, kind, in_params, out_params, *rest, preamble="", **kwargs):
        n_exprs = 1 if kind == "map" else 4  # then the name, as CuPy's classes take them
        self.kind, self.ins, self.outs, self.preamble = kind, in_params, out_params, preamble
        self.exprs, self.name = rest[:n_exprs], kwargs.get("name", rest[n_exprs] if len(rest) > n_exprs else "k")

    def source(self):
        decls, binds = [], []
        params = [(p, True) for p in self.ins.split(",")] + [(p, False) for p in self.outs.split(",")]
        for text, is_input in params:
            words = text.split()
            raw = words[0] == "raw"
            ctype, name = _CTYPES[words[raw]], words[raw + 1]
            const = "const " if is_input else ""
            if name in _SCALARS:
                decls.append(f"{const}{ctype} {name}")
            elif raw:
                decls.append(f"{const}CArray<{ctype}, 4, true, true> {name}")
            else:
                ndim = 1 if self.kind == "reduce" and not is_input else 3
                decls.append(f"{const}CArray<{ctype}, {ndim}, true, true> _raw_{name}")
                index = "_ind" if self.kind == "map" else ("_in_ind" if is_input else "_out_ind")
                binds.append((is_input, f"{const}{ctype} &{name} = _raw_{name}[{index}.get()];"))
        head = "#include <cupy/complex.cuh>\n#include <cupy/carray.cuh>\n" + self.preamble + "\n"
        if self.kind == "map":
            body = "\n".join(b for _, b in binds) + "\n" + self.exprs[0]
            return head + (f'extern "C" __global__ void {self.name}({", ".join(decls)}, CIndexer<3> _ind) '
                           f"{{ CUPY_FOR(i, _ind.size()) {{ _ind.set(i);\n{body};\n}} }}")
        map_expr, reduce_expr, post_map, identity = self.exprs
        rtype = _CTYPES[self.outs.split()[0]]
        ins = "\n".join(b for is_input, b in binds if is_input)
        outs = "\n".join(b for is_input, b in binds if not is_input)
        return head + f"""typedef {rtype} _type_reduce;
#define REDUCE(a, b) ({reduce_expr})
#define POST_MAP(a) ({post_map})
extern "C" __global__ void {self.name}({", ".join(decls)}, CIndexer<3> _in_ind, CIndexer<1> _out_ind) {{
  _type_reduce _s = _type_reduce({identity});
  for (ptrdiff_t _i = 0; _i < _in_ind.size(); ++_i) {{
    _in_ind.set(_i);
{ins}
    _s = REDUCE(_s, static_cast<_type_reduce>({map_expr}));
  }}
  _out_ind.set(0);
{outs}
  POST_MAP(_s);
}}"""


def test_cuda_sources_compile_with_nvrtc(monkeypatch):
    import re
    import types

    compile_source = _nvrtc_compiler()
    recorder = types.ModuleType("cupy")
    recorder.ElementwiseKernel = lambda *a, **k: _Recorded("map", *a, **k)
    recorder.ReductionKernel = lambda *a, **k: _Recorded("reduce", *a, **k)
    monkeypatch.setitem(sys.modules, "cupy", recorder)
    text = open(kernels.__file__).read()
    names = re.findall(r'if name == "(\w+)"', text[text.index("def _build("):text.index("def _kernel(")])
    assert len(names) >= 10
    errors = {name: compile_source(kernels._build(name).source()) for name in names}
    assert not any(errors.values()), {k: v[:2000] for k, v in errors.items() if v}
    bad = _Recorded("map", "raw complex64 far, int32 npix", "float32 w", "far[i] = far[i] * 2.f; w = 0.f;",
                    "writes_an_input")
    assert compile_source(bad.source())  # the check does catch a write into a (const) input


# --------------------------------------------------------------------------------------------------
# GPU: the fused CuPy path against the NumPy reference




def _on_gpu(cupy, *arrays):
    return [None if a is None else cupy.asarray(a) for a in arrays]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(64, 2, 128, 128)])
@pytest.mark.parametrize("noise", ["gaussian", "poisson"])
@pytest.mark.parametrize("background", [None, "pixel"])
def test_gpu_far_field_update_matches_reference(shape, noise, background, fused_restored):
    cupy = _cupy()
    kernels.set_fused(True)
    far, y, valid, bg = _case(shape, seed=12, background=background)
    ref = kernels.far_field_update(noise, far.copy(), y, valid, background=bg)
    gf, gy, gv, gb = _on_gpu(cupy, far, y, valid, bg)
    assert kernels.uses_fused(gf)
    dev = kernels.far_field_update(noise, gf, gy, gv, overwrite=True, background=gb)
    assert dev[0] is gf  # in place
    assert _rel(dev[0].get(), ref[0]) < 1e-5
    assert _rel(dev[1].get(), ref[1]) < 1e-6
    np.testing.assert_allclose(dev[2].get(), ref[2], rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(64, 1, 128, 128)])
@pytest.mark.parametrize("name", kernels.LOSS_NAMES)
def test_gpu_far_field_loss_matches_reference(shape, name, fused_restored):
    cupy = _cupy()
    kernels.set_fused(True)
    far, y, valid, bg = _case(shape, seed=13, background="scalar")
    ref = kernels.far_field_loss(name, far.copy(), y, valid, 1e-6, gradient=True, background=bg)
    gf, gy, gv, gb = _on_gpu(cupy, far, y, valid, bg)
    dev = kernels.far_field_loss(name, gf, gy, gv, 1e-6, gradient=True, background=gb)
    assert dev[1] is not gf  # not overwritten unless asked
    assert _rel(dev[1].get(), ref[1]) < 1e-5
    assert _rel(dev[2].get(), ref[2]) < 1e-6
    np.testing.assert_allclose(dev[0].get(), ref[0], rtol=1e-5)
    loss_only = kernels.far_field_loss(name, gf, gy, gv, 1e-6, gradient=False, background=gb)
    np.testing.assert_allclose(loss_only[0].get(), ref[0], rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(64, 3, 128, 128)])
def test_gpu_poisson_alpha_matches_reference(shape, fused_restored):
    cupy = _cupy()
    kernels.set_fused(True)
    far, y, valid, _ = _case(shape, seed=14)
    yhat = kernels.mode_intensity(far)
    ref = kernels.poisson_alpha(yhat, y, valid)
    dev = kernels.poisson_alpha(*_on_gpu(cupy, yhat, y, valid))
    np.testing.assert_allclose(dev.get(), ref, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(64, 2, 128, 128)])
def test_gpu_numerators_and_dots_match_reference(shape, fused_restored):
    cupy = _cupy()
    kernels.set_fused(True)
    rng = np.random.default_rng(15)
    sp, chi, bb = _complex(rng, shape), _complex(rng, shape), _complex(rng, shape)
    d = _complex(rng, (shape[0],) + shape[2:])
    w = rng.uniform(0.0, 2.0, d.shape).astype(np.float32)
    gsp, gchi, gbb, gd, gw = _on_gpu(cupy, sp, chi, bb, d, w)
    g_ref, w_ref = kernels.object_gradient(sp.copy(), chi)
    g_dev, w_dev = kernels.object_gradient(gsp, gchi)
    assert _rel(g_dev.get(), g_ref) < 1e-6 and _rel(w_dev.get(), w_ref) < 1e-6
    assert _rel(kernels.conj_product(gchi, gd).get(), kernels.conj_product(chi, d.copy())) < 1e-6
    for dev, ref in zip(kernels.step_dots(gd, gsp, gbb, gchi), kernels.step_dots(d, sp, bb, chi)):
        np.testing.assert_allclose(dev.get(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    for dev, ref in zip(kernels.object_step_dots(gd, gchi[:, 0], gw), kernels.object_step_dots(d, chi[:, 0], w)):
        np.testing.assert_allclose(dev.get(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
