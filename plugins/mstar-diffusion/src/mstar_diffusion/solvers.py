"""Update rules of a denoising step: how latents move from sigma[i] to sigma[i+1] given the guided velocity.

- `euler`: `x + (sigma[i+1] - sigma[i]) v`. Needs nothing from earlier steps.
- `unipc`: UniPC multistep, order 2, B(h) = e^h - 1 ("bh2"), predicting x0 from a flow velocity
  (`x0 = x - sigma v`), with the corrector on and lower orders at the start and the final step: what diffusers'
  `UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)` does by default (Wan's
  scheduler). It needs the last two x0 predictions and the last corrected sample: the step node outputs them as
  `solver_history` `[3, *latent]` and takes them back on its next call (the walk's `Loop` carries the name), so
  the engine still holds nothing for a request between steps.

All scalar coefficients are float32 tensors, as the reference computes them, so rows match it bit for bit
whatever else shares the batch.
"""

from __future__ import annotations

import torch

SOLVERS = ("euler", "unipc")
ORDER = 2


def unipc_order(index: int, num_steps: int) -> int:
    """The order used at step `index`: warming up from 1, and 1 again on the final step."""
    return min(ORDER, num_steps - index, min(index, ORDER) + 1)


def _lam(sigma: torch.Tensor) -> torch.Tensor:
    """log-SNR of a flow sigma: alpha = 1 - sigma."""
    return torch.log(1 - sigma) - torch.log(sigma)


def _coefficients(h: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(h_phi_1, B_h, b)` of the B(h)=expm1 variant, for the x0-predicting form (hh = -h)."""
    hh = -h
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    b_h = torch.expm1(hh)
    b, factorial = [], 1
    for k in range(1, order + 1):
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return h_phi_1, b_h, torch.stack(b)


def unipc_step(sigmas: torch.Tensor, index: int, x: torch.Tensor, v: torch.Tensor,
               history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One UniPC step of one request: `(x at sigma[index + 1], the history for the next step)`.

    `sigmas` float32 `[N + 1]`; `x`, `v` float32 latents; `history` `[3, *latent]` = (x0 at step i-1, x0 at step
    i-2, the corrected sample of step i-1), None at step 0.
    """
    n = sigmas.shape[0] - 1
    s = sigmas.to(x.device)
    m = x - s[index] * v  # this step's x0 prediction
    m_prev = m_prev2 = None
    if index > 0:
        if history is None:
            raise ValueError(f"unipc: step {index} needs the solver_history the previous step produced")
        m_prev, m_prev2, last = history.unbind(0)
        x = _correct(s, index, unipc_order(index - 1, n), x_last=last, m=m, m0=m_prev, m1=m_prev2)
    order = unipc_order(index, n)
    x_next = _predict(s, index, order, x, m0=m, m1=m_prev)
    new_history = torch.stack([m, m if m_prev is None else m_prev, x])
    return x_next, new_history


def _predict(s: torch.Tensor, i: int, order: int, x: torch.Tensor, m0: torch.Tensor,
             m1: torch.Tensor | None) -> torch.Tensor:
    sigma_t, sigma_s0 = s[i + 1], s[i]
    alpha_t = 1 - sigma_t
    lam_s0 = _lam(sigma_s0)
    h = _lam(sigma_t) - lam_s0
    h_phi_1, b_h, _ = _coefficients(h, order)
    x_t = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
    if order == 2:  # one earlier prediction; the reference's fixed rho of 1/2
        rk = (_lam(s[i - 1]) - lam_s0) / h
        x_t = x_t - alpha_t * b_h * (0.5 * ((m1 - m0) / rk))
    return x_t


def _correct(s: torch.Tensor, i: int, order: int, x_last: torch.Tensor, m: torch.Tensor, m0: torch.Tensor,
             m1: torch.Tensor) -> torch.Tensor:
    """UniC: re-derive sample i from sample i-1 using the model's output at i (x0 `m`) as well."""
    sigma_t, sigma_s0 = s[i], s[i - 1]
    alpha_t = 1 - sigma_t
    lam_s0 = _lam(sigma_s0)
    h = _lam(sigma_t) - lam_s0
    h_phi_1, b_h, b = _coefficients(h, order)
    x_t = sigma_t / sigma_s0 * x_last - alpha_t * h_phi_1 * m0
    if order == 1:
        return x_t - alpha_t * b_h * (0.5 * (m - m0))
    rk = (_lam(s[i - 2]) - lam_s0) / h
    rks = torch.stack([rk, torch.ones_like(rk)])
    rhos = torch.linalg.solve(torch.stack([torch.ones_like(rks), rks]), b)
    return x_t - alpha_t * b_h * (rhos[0] * ((m1 - m0) / rk) + rhos[1] * (m - m0))
