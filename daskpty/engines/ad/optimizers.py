"""AD optimisers over dicts of host arrays: :class:`Adam`, :class:`SGD`, :class:`ConjugateGradient`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PARAMETERS = ("object", "probe")

# --------------------------------------------------------------------------------------------------
# Optimisers: pure functions of (parameters, gradients, state) over dicts of host arrays


def inner(a: dict, b: dict) -> float:
    """Real inner product Re Σ conj(a)·b over every shared key, accumulated in float64."""
    total = 0.0
    for k in a:
        if k in b:
            x, y = a[k], b[k]
            if np.iscomplexobj(x) or np.iscomplexobj(y):
                x, y = np.asarray(x), np.asarray(y)
                total += float(np.sum(x.real * y.real, dtype=np.float64)
                               + np.sum(np.imag(x) * np.imag(y), dtype=np.float64))
            else:
                total += float(np.sum(x * y, dtype=np.float64))
    return total


@dataclass
class OptimizerState:
    """An optimiser's memory: plain NumPy arrays and floats, keyed ``"<slot>/<parameter>"``."""

    arrays: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)

    def get(self, slot: str, name: str):
        return self.arrays.get(f"{slot}/{name}")

    def set(self, slot: str, name: str, value) -> None:
        self.arrays[f"{slot}/{name}"] = value

    def crop_rows(self, start: int, stop: int) -> "OptimizerState":
        """A copy with the object's memory cut to rows [start, stop) (a tile of the object)."""
        return OptimizerState({k: v[..., start:stop, :].copy() if k.endswith("/object") else v
                               for k, v in self.arrays.items()}, dict(self.scalars))

    @staticmethod
    def stitch_rows(parts: list) -> "OptimizerState":
        """One memory from every tile's own rows (``parts``, in row order)."""
        first = parts[0]
        return OptimizerState({k: np.concatenate([p.arrays[k] for p in parts], axis=-2) if k.endswith("/object")
                               else v for k, v in first.arrays.items()}, dict(first.scalars))

    def paste_rows(self, start: int, part: "OptimizerState") -> None:
        """Write ``part``'s object rows (a :meth:`crop_rows` of another tile) into this memory's,
        from row ``start`` on, in place."""
        for k, v in part.arrays.items():
            if k.endswith("/object"):
                self.arrays[k][..., start:start + v.shape[-2], :] = v

    def drop(self, slot: str) -> None:
        for k in [k for k in self.arrays if k.startswith(slot + "/")]:
            del self.arrays[k]


def _cast(new, like):
    return new.astype(like.dtype, copy=False)


class Adam:
    """Adam (Kingma & Ba) on complex arrays: first moment complex, second moment |g|² (rotation invariant)."""

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def step(self, params: dict, grads: dict, lrs: dict, state: OptimizerState):
        out = dict(params)
        for name, g in grads.items():
            m, v = state.get("m", name), state.get("v", name)
            t = int(state.scalars.get(f"t/{name}", 0)) + 1
            m = (1 - self.beta1) * g if m is None else self.beta1 * m + (1 - self.beta1) * g
            g2 = (g.real**2 + np.imag(g) ** 2)
            v = (1 - self.beta2) * g2 if v is None else self.beta2 * v + (1 - self.beta2) * g2
            m, v = _cast(m, g), _cast(v, g2)
            state.set("m", name, m)
            state.set("v", name, v)
            state.scalars[f"t/{name}"] = float(t)
            m_hat = m / (1 - self.beta1**t)
            v_hat = v / (1 - self.beta2**t)
            out[name] = _cast(params[name] - lrs[name] * m_hat / (np.sqrt(v_hat) + self.eps), params[name])
        return out, state


class SGD:
    """Gradient descent with heavy-ball or Nesterov momentum: b ← μ b + g; p ← p − lr (g + μ b | b)."""

    def __init__(self, momentum: float = 0.0, nesterov: bool = False):
        self.momentum, self.nesterov = momentum, nesterov

    def step(self, params: dict, grads: dict, lrs: dict, state: OptimizerState):
        out = dict(params)
        for name, g in grads.items():
            update = g
            if self.momentum > 0:
                b = state.get("b", name)
                b = g if b is None else _cast(self.momentum * b + g, g)
                state.set("b", name, b)
                update = g + self.momentum * b if self.nesterov else b
            out[name] = _cast(params[name] - lrs[name] * update, params[name])
        return out, state


class ConjugateGradient:
    """Nonlinear CG, Polak–Ribière+ with restarts, and a line search that needs only loss values.

    ``grads`` are the exact gradients g, ``precond`` the preconditioned ones s = M⁻¹g (pass
    ``precond=grads`` for none); per-parameter ``lrs`` scale s as part of the preconditioner, so a
    line-search step α = 1 is one SGD step. Direction ``d = −s + β d_prev`` with
    ``β = max(0, ⟨g, s − s_prev⟩ / ⟨g_prev, s_prev⟩)``; restart (β = 0) when d is not a descent
    direction or the parameter set changed.

    Line search along d from the last accepted α: evaluate L(α₀); fit the parabola through L(0),
    L'(0) = ⟨g, d⟩ and L(α₀), evaluate its minimiser α₁; accept the lower of the two if it meets
    Armijo's condition L(α) ≤ L(0) + c₁ α L'(0), else backtrack (α ← ρ·α). On a quadratic the
    interpolated step is the exact minimiser, so CG terminates in ≤ dim steps (up to rounding).
    """

    def __init__(self, c1: float = 1e-4, backtrack: float = 0.5, max_evaluations: int = 6,
                 interpolate: bool = True, grow: float = 1.5):
        self.c1, self.backtrack, self.max_evaluations = c1, backtrack, max_evaluations
        self.interpolate, self.grow = interpolate, grow

    def direction(self, grads: dict, precond: dict, lrs: dict, state: OptimizerState) -> tuple[dict, float]:
        s = {k: lrs[k] * precond[k] for k in grads}
        names = sorted(grads)
        same = state.scalars.get("cg_names") == float(_names_code(names))
        beta = 0.0
        d_prev = {k: state.get("cg_d", k) for k in names}
        s_prev = {k: state.get("cg_s", k) for k in names}
        g_prev = {k: state.get("cg_g", k) for k in names}
        if same and all(v is not None for v in (*d_prev.values(), *s_prev.values(), *g_prev.values())):
            denom = inner(g_prev, s_prev)
            if denom > 0:
                beta = max(0.0, (inner(grads, s) - inner(grads, s_prev)) / denom)
        d = {k: -s[k] + beta * d_prev[k] if beta > 0 else -s[k] for k in names}
        slope = inner(grads, d)
        if slope >= 0 and beta > 0:     # not a descent direction: restart along −s
            d = {k: -s[k] for k in names}
            slope = inner(grads, d)
        state.drop("cg_d"), state.drop("cg_s"), state.drop("cg_g")
        for k in names:
            state.set("cg_d", k, d[k])
            state.set("cg_s", k, s[k])
            state.set("cg_g", k, grads[k])
        state.scalars["cg_names"] = float(_names_code(names))
        state.scalars["cg_beta"] = beta
        return d, slope

    def step(self, params: dict, grads: dict, precond: dict, lrs: dict, loss0: float, evaluate,
             state: OptimizerState):
        """One CG iteration. ``evaluate(params) -> loss`` (same data as ``loss0``). Returns (params, state)."""
        d, slope = self.direction(grads, precond, lrs, state)
        alpha0 = state.scalars.get("cg_alpha", 1.0)
        evaluations = 0
        if not slope < 0 or not math.isfinite(slope):
            state.scalars["cg_evaluations"] = 0.0
            return dict(params), state

        def trial(a):
            nonlocal evaluations
            evaluations += 1
            p = {k: _cast(params[k] + a * d[k], params[k]) if k in d else params[k] for k in params}
            return p, float(evaluate(p))

        def armijo(a, value):
            return math.isfinite(value) and value <= loss0 + self.c1 * a * slope

        best = None
        alpha = alpha0
        while evaluations < self.max_evaluations:
            p, value = trial(alpha)
            candidates = [(value, alpha, p)]
            if self.interpolate and evaluations < self.max_evaluations and math.isfinite(value):
                curvature = (value - loss0 - slope * alpha) / (alpha * alpha)
                if curvature > 0:
                    a1 = min(max(-slope / (2 * curvature), 1e-3 * alpha), 1e3 * alpha)
                    p1, v1 = trial(a1)
                    candidates.append((v1, a1, p1))
            ok = [c for c in candidates if armijo(c[1], c[0])]
            if ok:
                best = min(ok, key=lambda c: c[0])
                break
            finite = [c[1] for c in candidates if math.isfinite(c[0])]
            alpha = self.backtrack * (min(finite) if finite else alpha)
        state.scalars["cg_evaluations"] = float(evaluations)
        if best is None:                 # no acceptable step: stay, restart, try shorter next time
            state.drop("cg_d")
            state.scalars["cg_alpha"] = alpha
            return dict(params), state
        state.scalars["cg_alpha"] = best[1] * self.grow if best[1] >= alpha0 else best[1]
        state.scalars["cg_last_alpha"] = best[1]
        return best[2], state


def _names_code(names) -> int:
    return sum(1 << PARAMETERS.index(n) for n in names if n in PARAMETERS)
