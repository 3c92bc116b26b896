"""Inner (fast-weight) update rules behind one interface (NL §2.3; MECHANISMS §6).

Every rule acts on one linear map of a memory, batched over samples, and returns
the new fast delta Δ (the weight in force is θ0 + Δ, MECHANISMS §2 "Meta vs fast")
and the new momentum. One call = one chunk boundary (NL eq. 31):

    grad    [B, O, I]  Σ_{t∈chunk} g_t x_tᵀ, the chunk-summed gradient of the inner
                       objective at the chunk-start weights (rank-1 per token)
    inputs  [B, C, I]  the map's inputs x_t over the chunk (used by the DGD erase term)
    weight  [B, O, I]  θ0 + Δ, the chunk-start weight (used by the erase term)
    gate    [B]        surprise gate (MECHANISMS §4): where False the state is unchanged

Retention α acts on Δ only, i.e. it pulls the weight back toward θ0 (α = 1 keeps Δ).
Everything is sync-free: no Python branch depends on tensor values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from hope.layers import gelu_prime
from hope.optim.newton_schulz import cubic_iteration


def _keep_where(gate: Tensor | None, new: Tensor, old: Tensor) -> Tensor:
    """new where the gate is open, old where it is closed (per sample, no host sync)."""
    if gate is None:
        return new
    mask = gate.to(torch.bool).view(-1, *([1] * (new.dim() - 1)))
    return torch.where(mask, new, old)


def erase_term(weight: Tensor, inputs: Tensor) -> Tensor:
    """W · Σ_t x_t x_tᵀ as rank-1 factors: Σ_t (W x_t) x_tᵀ.  [B, O, I]

    This is the chunk-level DGD erase (NL "Going Beyond Simple Backpropagation"):
    it removes from W what it currently maps along each x_t.
    """
    read = torch.einsum("boi,bci->bco", weight, inputs)  # [B, C, O]
    return torch.einsum("bco,bci->boi", read, inputs)


def newton_schulz(x: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Batched cubic Newton–Schulz orthogonalisation of x [B, O, I] (NL "None Linear Outputs")."""
    return cubic_iteration(x, steps, eps)


class InnerRule(ABC):
    """One chunk-boundary update Δ, m ← rule(Δ, m, grad, inputs, weight), gated per sample."""

    def __init__(self, lr: float, retention: float = 1.0) -> None:
        if lr < 0:
            raise ValueError(f"inner rule: lr must be >= 0, got {lr}")
        if not 0.0 <= retention <= 1.0:
            raise ValueError(f"inner rule: retention must be in [0, 1], got {retention}")
        self.lr = lr
        self.retention = retention

    uses_momentum: bool = False
    uses_inputs: bool = False

    def momentum_shape(self, out_dim: int, in_dim: int) -> tuple[int, ...]:
        """Shape of the momentum state of one map [O, I] (zero at context start)."""
        return (out_dim, in_dim)

    # Elementwise and linear in (Δ, m, G) with scalar coefficients: Δ_n is a scalar
    # combination of Δ_0, m_0 and the chunk gradients (the CMS dual read relies on it).
    linear: bool = False

    def linear_step(self) -> tuple[list[list[float]], list[float]]:
        """A linear rule's open-gate update as (A, b): state' = A state + b G over the
        state (Δ) or (Δ, m), from the rule's own coefficients (host floats)."""
        raise NotImplementedError(f"{type(self).__name__} is not a linear rule")

    @abstractmethod
    def _update(
        self,
        delta: Tensor,
        momentum: Tensor | None,
        grad: Tensor,
        inputs: Tensor | None,
        weight: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Ungated update."""

    def step(
        self,
        delta: Tensor,
        momentum: Tensor | None,
        grad: Tensor,
        inputs: Tensor | None = None,
        weight: Tensor | None = None,
        gate: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Apply one chunk update; samples whose gate is closed keep Δ and m unchanged."""
        if self.uses_momentum and momentum is None:
            raise ValueError(f"{type(self).__name__} needs a momentum buffer (got None)")
        if self.uses_inputs and (inputs is None or weight is None):
            raise ValueError(f"{type(self).__name__} needs the chunk inputs and current weight")
        new_delta, new_momentum = self._update(delta, momentum, grad, inputs, weight)
        delta_out = _keep_where(gate, new_delta, delta)
        if new_momentum is None or momentum is None:
            return delta_out, new_momentum
        return delta_out, _keep_where(gate, new_momentum, momentum)


class GDRule(InnerRule):
    """Plain GD with retention (NL eq. 31): Δ ← αΔ − η G."""

    linear = True

    def _update(self, delta, momentum, grad, inputs, weight):  # type: ignore[no-untyped-def]
        return self.retention * delta - self.lr * grad, momentum

    def linear_step(self) -> tuple[list[list[float]], list[float]]:
        return [[self.retention]], [-self.lr]


class MomentumRule(InnerRule):
    """Momentum as a memory of gradients (NL §2.3): m ← βm − ηG; Δ ← αΔ + m."""

    uses_momentum = True
    linear = True

    def __init__(self, lr: float, retention: float = 1.0, beta: float = 0.9) -> None:
        super().__init__(lr, retention)
        self.beta = beta

    def _update(self, delta, momentum, grad, inputs, weight):  # type: ignore[no-untyped-def]
        new_m = self.beta * momentum - self.lr * grad
        return self.retention * delta + new_m, new_m

    def linear_step(self) -> tuple[list[list[float]], list[float]]:
        # Δ' = αΔ + (βm − ηG), m' = βm − ηG
        return [[self.retention, self.beta], [0.0, self.beta]], [-self.lr, -self.lr]


class DGDRule(InnerRule):
    """DGD with erase (NL "Going Beyond Simple Backpropagation"), at chunk granularity.

    With W = θ0 + Δ the chunk-start weight and P = Σ_{t∈chunk} x_t x_tᵀ:
        W_new = θ0 + αΔ − η′ W P − η G     (α = 1: W_new = W(I − η′P) − ηG)
    i.e. the paper's W(αI − η′ x xᵀ) − η g xᵀ summed over the chunk to first order,
    with the retention α acting on Δ only. Optional momentum (β > 0) replaces −ηG by
    m ← βm − ηG. Stable only while η′·||P|| < 2; with RMS-normalised inputs
    ||x_t||² ≈ d, so η′ must be well below 2/(C·d).
    """

    uses_inputs = True

    def __init__(self, lr: float, erase: float, retention: float = 1.0, beta: float = 0.0) -> None:
        super().__init__(lr, retention)
        if erase < 0:
            raise ValueError(f"DGDRule: erase must be >= 0, got {erase}")
        self.erase = erase
        self.beta = beta
        self.uses_momentum = beta > 0

    def _update(self, delta, momentum, grad, inputs, weight):  # type: ignore[no-untyped-def]
        write = -self.lr * grad
        new_m = momentum
        if self.uses_momentum:
            new_m = self.beta * momentum + write
            write = new_m
        return self.retention * delta - self.erase * erase_term(weight, inputs) + write, new_m


class DeltaMomentumRule(InnerRule):
    """Delta-rule momentum (NL "More Expressive Objectives"), P = I:

        m ← m(βI − ε GᵀG) − ηG;  Δ ← αΔ + m

    the gradient of ||m Gᵀ − I||² w.r.t. m, written with right-multiplication so the
    shapes close (m, G are [O, I]); ε scales the delta (forgetting) term.
    """

    uses_momentum = True

    def __init__(
        self, lr: float, retention: float = 1.0, beta: float = 0.9, delta_coef: float = 1.0
    ) -> None:
        super().__init__(lr, retention)
        self.beta = beta
        self.delta_coef = delta_coef

    def _update(self, delta, momentum, grad, inputs, weight):  # type: ignore[no-untyped-def]
        gram = grad.transpose(-1, -2) @ grad  # [B, I, I]
        new_m = self.beta * momentum - self.delta_coef * (momentum @ gram) - self.lr * grad
        return self.retention * delta + new_m, new_m


def precondition_by_inputs(grad: Tensor, inputs: Tensor, damping: float) -> Tensor:
    """G (εI + XᵀX/C)⁻¹ for grad G [B, O, I] and the chunk's inputs X [B, C, I],
    through Woodbury: (1/ε)(G − (G Xᵀ)(εC·I + X Xᵀ)⁻¹ X), one C×C solve per sample."""
    chunk = inputs.shape[1]
    eye = torch.eye(chunk, dtype=inputs.dtype, device=inputs.device)
    system = damping * chunk * eye + inputs @ inputs.transpose(-1, -2)  # [B, C, C]
    solved = torch.linalg.solve(system, inputs)  # (εC·I + X Xᵀ)⁻¹ X  [B, C, I]
    return (grad - (grad @ inputs.transpose(-1, -2)) @ solved) / damping


class PrecondMomentumRule(InnerRule):
    """Preconditioned momentum (NL "More Expressive Association", eq. 21):

        m ← βm − η G P;  Δ ← αΔ + m,   P = (εI + XᵀX/C)⁻¹

    Eq. 21 leaves the value P_i open ("a function of gradients, e.g. information about
    the Hessian"); ours is the inverse second moment of the map's inputs over the chunk,
    the input factor of the Gauss–Newton curvature of a linear map (K-FAC). It shrinks
    the step along directions the chunk's inputs share and never enlarges it past 1/ε.
    """

    uses_momentum = True
    uses_inputs = True

    def __init__(
        self, lr: float, retention: float = 1.0, beta: float = 0.9, damping: float = 1.0
    ) -> None:
        super().__init__(lr, retention)
        if damping <= 0:
            raise ValueError(f"PrecondMomentumRule: damping must be > 0, got {damping}")
        self.beta = beta
        self.damping = damping

    def _update(self, delta, momentum, grad, inputs, weight):  # type: ignore[no-untyped-def]
        step = precondition_by_inputs(grad, inputs.to(grad.dtype), self.damping)
        new_m = self.beta * momentum - self.lr * step
        return self.retention * delta + new_m, new_m


class DeepMomentumRule(InnerRule):
    """Deep momentum gradient descent, DMGD (NL "More Expressive Memory", eq. 23):

        θ_m ← θ_m0 + β(θ_m − θ_m0) − η ∇_θ ⟨m_θ(û), u⟩;   Δ ← αΔ + m_θ(û)

    with u = G flattened (O·I), û = u/‖u‖, and the momentum memory an MLP
    m_θ(x) = W_b gelu(W_a x), θ = (W_a [r, O·I], W_b [O·I, r]) per sample: a memory
    of past gradients keyed by their direction. Eq. 23 leaves the memory's inner
    objective open (its example ⟨m(uᵀ), 1⟩ does not reduce to momentum); ours is
    the value-less objective of plain momentum (eq. 18's ⟨m, u⟩) with the memory's
    output in place of m: with constant features (gelu(W_a û) ≡ 1) it is exactly
    m ← βm − ηu, and otherwise the update is Σ_i c_i u_i with past gradients weighted by
    their feature similarity to the current one. θ_m0: W_b = 0 and W_a a fixed random
    N(0, 1) (``key_init``); like every rule's retention, β pulls θ back toward θ_m0
    (decaying W_a to zero would erase the memory's addressing). The state is
    θ − θ_m0 packed as [B, 2r, O·I] (rows of W_a − W_a0, then W_bᵀ), zero at start.
    """

    uses_momentum = True

    def __init__(
        self, lr: float, retention: float = 1.0, beta: float = 0.9, width: int = 4
    ) -> None:
        super().__init__(lr, retention)
        if width < 1:
            raise ValueError(f"DeepMomentumRule: width must be >= 1, got {width}")
        self.beta = beta
        self.width = width
        self._keys: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}

    def momentum_shape(self, out_dim: int, in_dim: int) -> tuple[int, ...]:
        return (2 * self.width, out_dim * in_dim)

    def key_init(self, size: int, like: Tensor) -> Tensor:
        """W_a0 [r, size]: one fixed N(0, 1) draw per map size, cached per device."""
        cache = (size, like.device, like.dtype)
        if cache not in self._keys:
            gen = torch.Generator().manual_seed(size)
            draw = torch.randn(self.width, size, generator=gen, dtype=torch.float64)
            self._keys[cache] = draw.to(device=like.device, dtype=like.dtype)
        return self._keys[cache]

    @staticmethod
    def features(pre: Tensor) -> tuple[Tensor, Tensor]:
        """The memory's hidden layer gelu(z) and its slope gelu′(z)."""
        return F.gelu(pre), gelu_prime(pre)

    def _update(self, delta, momentum, grad, inputs, weight):  # type: ignore[no-untyped-def]
        u = grad.flatten(1)  # [B, N]
        key = u / u.norm(dim=1, keepdim=True).clamp_min(1e-30)
        d_a, w_bt = momentum.split(self.width, dim=1)  # [B, r, N] each
        w_a0 = self.key_init(u.shape[1], u)
        pre = ((w_a0 + d_a) @ key.unsqueeze(-1)).squeeze(-1)  # [B, r]
        feat, slope = self.features(pre)
        # ∇ of ⟨W_b gelu(W_a x), u⟩: W_b: u featᵀ; W_a: ((W_bᵀ u) ⊙ gelu′(pre)) xᵀ
        back = (w_bt @ u.unsqueeze(-1)).squeeze(-1) * slope  # [B, r]
        new_a = self.beta * d_a - self.lr * back.unsqueeze(-1) * key.unsqueeze(1)
        new_bt = self.beta * w_bt - self.lr * feat.unsqueeze(-1) * u.unsqueeze(1)
        new_feat, _ = self.features(((w_a0 + new_a) @ key.unsqueeze(-1)).squeeze(-1))
        step = (new_feat.unsqueeze(1) @ new_bt).squeeze(1).view_as(grad)  # m_{i+1}(û_i)
        return self.retention * delta + step, torch.cat([new_a, new_bt], dim=1)


class OrthoMomentumRule(InnerRule):
    """Momentum with Newton–Schulz output (NL "None Linear Outputs", Muon-like):

    m ← βm + G;  Δ ← αΔ − η NS(m)
    """

    uses_momentum = True

    def __init__(
        self, lr: float, retention: float = 1.0, beta: float = 0.9, ns_steps: int = 5
    ) -> None:
        super().__init__(lr, retention)
        self.beta = beta
        self.ns_steps = ns_steps

    def _update(self, delta, momentum, grad, inputs, weight):  # type: ignore[no-untyped-def]
        new_m = self.beta * momentum + grad
        return self.retention * delta - self.lr * newton_schulz(new_m, self.ns_steps), new_m


RULES = (
    "gd", "momentum", "dgd", "delta_momentum", "ortho_momentum", "precond_momentum",
    "deep_momentum",
)  # fmt: skip


def make_inner_rule(
    name: str, lr: float, retention: float, momentum: float, erase: float, width: int = 0
) -> InnerRule:
    """The rule named by ``model.cms_rule`` with the CMS knobs (cms_lr, cms_retention,
    cms_momentum = β, cms_erase = DGD's η′, the delta rule's ε or the preconditioner's
    damping ε, cms_momentum_width = DMGD's r)."""
    if name == "gd":
        return GDRule(lr, retention=retention)
    if name == "momentum":
        return MomentumRule(lr, retention=retention, beta=momentum)
    if name == "dgd":
        return DGDRule(lr, erase, retention=retention, beta=momentum)
    if name == "delta_momentum":
        return DeltaMomentumRule(lr, retention=retention, beta=momentum, delta_coef=erase)
    if name == "ortho_momentum":
        return OrthoMomentumRule(lr, retention=retention, beta=momentum)
    if name == "precond_momentum":
        return PrecondMomentumRule(lr, retention=retention, beta=momentum, damping=erase)
    if name == "deep_momentum":
        return DeepMomentumRule(lr, retention=retention, beta=momentum, width=width)
    raise ValueError(f"unknown inner rule {name!r}; expected one of {', '.join(RULES)}")
