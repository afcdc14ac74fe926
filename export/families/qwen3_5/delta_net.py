"""Qwen3.5's Gated DeltaNet layer as a torch module that exports to standard ONNX ops.

It computes what transformers 5.24's `Qwen3_5GatedDeltaNet` computes without a cache (the
pinned reference, docs/reference-colqwen3_5.md): padding rows zeroed, the depthwise causal
conv1d (zero initial state) and SiLU, the gates beta = sigmoid(b) and
g = -exp(A_log) * softplus(a + dt_bias), l2-normed q and k, q scaled by head_dim^-0.5, the gated
delta rule in 64-token chunks, the gated RMS norm and the output projection. Parameter names
are the reference layer's, so its state dict loads as it is.

Two steps differ in form, not in what they compute, so that the graph has no data-dependent
loop and every op is one DirectML registers:
- inside a chunk, the unit lower-triangular system (I + N) X = B that the reference solves by
  substitution is solved with its inverse built by block doubling: with D the inverse of the
  block diagonal at block size b and E the strictly-lower blocks joining pairs of them,
  (D^-1 + E)^-1 = D - D E D exactly (E D E = 0), six levels from b = 1 to 64;
- across chunks, the state recurrence S_i = d_i S_{i-1} + K_i^T (U_i - W_i S_{i-1}) is affine,
  S_i = M_i S_{i-1} + C_i: the pairs of GROUP consecutive chunks are composed (a fixed, unrolled
  sequence), the groups' pairs scanned by doubling (Hillis-Steele), and each group's incoming
  state carried through its chunks (`chunk_states`). `scan_levels` levels serve up to
  64 * GROUP * 2**scan_levels tokens (`max_tokens`; a longer input is refused).
Each chunk's output is then the reference's: Q_i S_{i-1} + A_i (U_i - W_i S_{i-1}).
benchmarks/results/experiments/qwen3_5-delta-rule.md measures the distance and the time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 64  # the reference's chunk size (torch_chunk_gated_delta_rule's default)
GROUP = 4  # chunks composed in sequence before the scan
SCAN_LEVELS = 6  # groups of 4 chunks: 64 * 4 * 2**6 = 16,384 tokens


def max_tokens(scan_levels: int = SCAN_LEVELS) -> int:
    """The longest sequence a layer with `scan_levels` scan levels computes exactly."""
    return CHUNK * GROUP * 2**scan_levels


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _block_masks(size: int) -> list[torch.Tensor]:
    """For b = 1, 2, 4, ...: the mask of the strictly-lower b x b blocks joining pairs of b-blocks
    (rows in the second half of a 2b block, columns in its first half)."""
    index = torch.arange(size)
    masks = []
    b = 1
    while b < size:
        row_block, col_block = index[:, None] // (2 * b), index[None, :] // (2 * b)
        lower = (index[:, None] % (2 * b)) >= b
        upper = (index[None, :] % (2 * b)) < b
        masks.append(((row_block == col_block) & lower & upper).float())
        b *= 2
    return masks


def unit_lower_inverse(strict_lower: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """(I + N)^-1 for N strictly lower triangular (last two dims), by block doubling."""
    size = strict_lower.shape[-1]
    inverse = torch.eye(size, dtype=strict_lower.dtype).expand_as(strict_lower)
    for mask in masks:
        joining = strict_lower * mask
        inverse = inverse - inverse @ joining @ inverse
    return inverse


def chunk_states(transition: torch.Tensor, offset: torch.Tensor, scan_levels: int) -> torch.Tensor:
    """The state entering each chunk, S_{i-1}, of S_i = M_i S_{i-1} + C_i with S_0 = 0.

    transition (B, H, n, dk, dk), offset (B, H, n, dk, dv), n a multiple of GROUP. Chunks are
    taken GROUP at a time: each group's pair is composed in sequence, the groups' pairs scanned
    by doubling (`scan_levels` levels, each a product per group), and each group's incoming state
    carried through its chunks in sequence.
    """
    batch, heads, _, k_dim, v_dim = offset.shape
    eye = torch.eye(k_dim, dtype=transition.dtype)
    transition = transition.reshape(batch, heads, -1, GROUP, k_dim, k_dim)
    offset = offset.reshape(batch, heads, -1, GROUP, k_dim, v_dim)
    groups = transition.shape[2]

    group_m, group_c = transition[:, :, :, 0], offset[:, :, :, 0]
    for j in range(1, GROUP):
        group_c = transition[:, :, :, j] @ group_c + offset[:, :, :, j]
        group_m = transition[:, :, :, j] @ group_m
    for level in range(scan_levels):
        shift = 2**level
        ones = eye.expand(batch, heads, shift, k_dim, k_dim)
        zeros = offset.new_zeros(1, 1, 1, 1, 1).expand(batch, heads, shift, k_dim, v_dim)
        group_c = group_m @ torch.cat([zeros, group_c], 2)[:, :, :groups] + group_c
        if level + 1 < scan_levels:
            group_m = group_m @ torch.cat([ones, group_m], 2)[:, :, :groups]
    zero = offset.new_zeros(1, 1, 1, 1, 1).expand(batch, heads, 1, k_dim, v_dim)
    states = [torch.cat([zero, group_c], 2)[:, :, :groups]]
    for j in range(1, GROUP):
        states.append(transition[:, :, :, j - 1] @ states[-1] + offset[:, :, :, j - 1])
    return torch.stack(states, dim=3).reshape(batch, heads, -1, k_dim, v_dim)


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    scan_levels: int = SCAN_LEVELS,
) -> torch.Tensor:
    """The reference's `torch_chunk_gated_delta_rule` (no initial state, q/k l2-normed inside).

    query, key: (B, L, Hk, dk); value: (B, L, Hv, dv); decay, beta: (B, L, Hv). Returns
    (B, L, Hv, dv) float32.
    """
    batch, length, k_heads, k_dim = key.shape
    v_heads = value.shape[2]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, decay = (
        x.transpose(1, 2).to(torch.float32) for x in (query, key, value, beta, decay)
    )
    query = _l2norm(query)
    key = _l2norm(key)
    query = query * k_dim**-0.5

    # Whole groups of chunks (padding tokens come after every real one, so they change none);
    # the pad without Mod, which DirectML has none of for int64.
    span = CHUNK * GROUP
    pad = (length + span - 1) // span * span - length
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1])
        for x in (query, key, k_beta, v_beta)
    )
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, CHUNK)

    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    cum = decay.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)

    inverse = unit_lower_inverse(ut_system.tril(-1), _block_masks(CHUNK))
    new_values = inverse @ v_beta  # U_i
    k_cumdecay = inverse @ decayed_k_beta  # W_i

    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    # S_i = M_i S_{i-1} + C_i, M_i = d_i I - K_i^T W_i, C_i = K_i^T U_i; S_0 = 0.
    key_t = key.transpose(-1, -2)
    eye = torch.eye(k_dim, dtype=torch.float32)
    transition = chunk_decay * eye - key_t @ k_cumdecay
    offset = key_t @ new_values
    incoming = chunk_states(transition, offset, scan_levels)

    v_new = new_values - k_cumdecay @ incoming
    out = query @ incoming + intra @ v_new
    out = out.reshape(batch, v_heads, -1, out.shape[-1])[:, :, :length]
    return out.transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """`Qwen3_5RMSNormGated`: RMS norm (float32), times the weight, times silu(gate)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Qwen3.5 linear-attention layer; forward(hidden (B, L, D), mask (B, L)) -> (B, L, D).

    Batches are right-padded: a real token never sees a later one, so padding cannot change it.
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
        scan_levels: int = SCAN_LEVELS,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) is not a multiple of "
                f"linear_num_key_heads ({num_k_heads})"
            )
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = head_k_dim * num_k_heads, head_v_dim * num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.scan_levels = scan_levels
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)

    @classmethod
    def from_config(cls, text_config, scan_levels: int = SCAN_LEVELS) -> GatedDeltaNet:
        """From a Qwen3.5 text config (an object or a dict with the transformers field names)."""
        get = text_config.get if isinstance(text_config, dict) else text_config.__getattribute__
        return cls(
            get("hidden_size"),
            get("linear_num_key_heads"),
            get("linear_num_value_heads"),
            get("linear_key_head_dim"),
            get("linear_value_head_dim"),
            get("linear_conv_kernel_dim"),
            get("rms_norm_eps"),
            scan_levels,
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        if not torch.compiler.is_exporting() and length > max_tokens(self.scan_levels):
            raise ValueError(
                f"{length} tokens: this layer computes at most {max_tokens(self.scan_levels)} "
                f"exactly ({self.scan_levels} scan levels)"
            )
        hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
        mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)
        mixed = F.conv1d(
            mixed,
            self.conv1d.weight,
            padding=self.conv_kernel - 1,
            groups=self.conv_dim,
        )[:, :, :length]
        mixed = F.silu(mixed).transpose(1, 2)
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], -1)
        query = query.reshape(batch, length, -1, self.head_k_dim)
        key = key.reshape(batch, length, -1, self.head_k_dim)
        value = value.reshape(batch, length, -1, self.head_v_dim)
        z = self.in_proj_z(hidden_states).reshape(batch, length, -1, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(
            self.in_proj_a(hidden_states).float() + self.dt_bias
        )
        core = gated_delta_rule(query, key, value, decay, beta, self.scan_levels)
        core = core.to(hidden_states.dtype)
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(batch, length, -1))
