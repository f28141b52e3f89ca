"""AD engine: exact reverse-mode gradients from the physics operators' hand-written adjoints.

Same forward model as LSQML (design.md), per pattern j and probe mode k::

    Q_jk = S_{f_j} P_k,   ψ_jk = Q_jk · O[r_j window],   Ψ_jk = F ψ_jk,   ŷ_j = Σ_k |Ψ_jk|²,

and a data loss L(Ψ) = Σ_j Σ_pixels h(ŷ_j, y_j). The gradient is propagated backwards through the
chain of adjoints (no autograd, no tape; NumPy and CuPy alike, the namespace of the input):

    g_Ψ = ∇_Ψ L  →  g_ψ = F⁻¹ g_Ψ  →  object: Σ_k conj(Q_jk) g_ψjk, scatter-added at r_j
                                     probe:  Σ_j S_{-f_j}(conj(O_j) g_ψj)
                                     positions: Re⟨F[conj(O_j) g_ψj], (−2πi k) F[P] ramp_j⟩.

**Complex gradient convention.** For a real function f of complex z we use
``g = ∂f/∂Re z + i ∂f/∂Im z`` (= 2 ∂f/∂z̄), so a first-order change is
``δf = Re⟨g, δz⟩ = Re Σ conj(g)·δz``. Gradient descent is ``z ← z − lr·g``. The finite-difference
tests check exactly this relation.

Layout of this package (no dask in here):

* :mod:`.losses` — losses with value and gradient w.r.t. Ψ: :func:`gaussian_loss_gradient`,
  :func:`poisson_loss_gradient`, :func:`intensity_loss_gradient` (:data:`LOSS_GRADIENTS`);
* :mod:`.gradient` — :func:`chunk_gradient` / :func:`chunk_loss`: per-chunk additive :class:`Partial` results, one
  pass over cache-sized sub-batches of the chunk on the CPU (the whole chunk on the GPU);
* :mod:`.optimizers` — optimisers over dicts of host arrays: :class:`Adam`, :class:`SGD` (heavy-ball / Nesterov),
  :class:`ConjugateGradient` (Polak–Ribière+, Armijo backtracking with one quadratic interpolation
  that needs loss values only); their memory is an :class:`OptimizerState` of plain NumPy arrays
  and floats (checkpointable without pickle);
* :mod:`.state` — :class:`ADOptions`, :class:`ADState`, :func:`apply`, :func:`begin_epoch`, :func:`end_epoch`.

Precision: the working precision is complex128 when the object or probe is complex128, complex64
otherwise; loss values are accumulated in float64 (the Poisson loss's pixel terms are also formed
in float64; the Gaussian and intensity losses' squared residuals in the working precision)."""
from __future__ import annotations

# The package's public names (and the few private ones the tests use), re-exported.
# ruff: noqa: F401
from ..lsqml import forward_sums, rescale_probe
from .gradient import CPU_BLOCK_BYTES, _split, chunk_gradient, chunk_loss, refining_chunk_gradient
from .losses import (
    DEFAULT_EPS,
    LOSS_GRADIENTS,
    LOSS_NAMES,
    _far_field_loss,
    gaussian_loss_gradient,
    intensity_loss_gradient,
    loss_and_gradient,
    poisson_loss_gradient,
)
from .optimizers import PARAMETERS, SGD, Adam, ConjugateGradient, OptimizerState, inner
from .state import (
    DEFAULT_LR,
    OPTIMIZERS,
    SCHEDULES,
    ADOptions,
    ADState,
    apply,
    begin_epoch,
    end_epoch,
    normalize_scale,
    orthogonalize_probe,
)
