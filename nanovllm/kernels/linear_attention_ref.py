"""Plain torch Gated DeltaNet pieces (Qwen3.5 / Qwen3-Next linear attention): the short causal conv
over each sequence with its conv state, and the gated delta rule with its recurrent state. The CPU
path, the fallback on CUDA without fla-core, and the oracle of the GPU tests.

The delta rule, per value head, with the state S: [k_dim, v_dim], q and k L2-normalised and q scaled
by k_dim ** -0.5, for each token t:
    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
computed in fp32. Key heads serve num_v_heads // num_k_heads consecutive value heads each (the
grouping of transformers' repeat_interleave)."""
import torch
import torch.nn.functional as F

CHUNK = 64   # tokens per block of the chunked (WY) form of the delta rule


# ---- causal conv ------------------------------------------------------------------------------

def conv_window_index(cu_seqlens: torch.Tensor, num_tokens: int, width: int) -> torch.Tensor:
    """For the varlen conv: row r of [states | x] that tap j of token t reads, [num_tokens, width].
    The rows [states | x] are each sequence's width - 1 state rows (sequence i's at i * (width - 1)),
    then the tokens. Tap width - 1 is the token itself; a tap before the sequence's first token reads
    its state. Device tensors only: no host sync."""
    num_seqs, hist = cu_seqlens.numel() - 1, width - 1
    t = torch.arange(num_tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), t, right=True)         # [num_tokens]
    pos = t - cu_seqlens.long()[seq]                                        # position in the chunk
    src = pos[:, None] - hist + torch.arange(width, device=t.device)       # [num_tokens, width]
    from_x = num_seqs * hist + t[:, None] - hist + torch.arange(width, device=t.device)
    from_state = seq[:, None] * hist + hist + src
    return torch.where(src >= 0, from_x, from_state)


def causal_conv_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                       cu_seqlens: torch.Tensor, activation: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of each sequence's tokens after its state (the inputs before them).
    x: [num_tokens, channels] (sequences back to back, cu_seqlens: [num_seqs + 1]);
    weight: [channels, width]; states: [num_seqs, channels, width - 1], oldest first (zeros: none).
    -> (silu(conv): [num_tokens, channels], the new states: [num_seqs, channels, width - 1])."""
    num_tokens, width = x.shape[0], weight.shape[1]
    rows = torch.cat([states.transpose(1, 2).reshape(-1, x.shape[1]).to(x.dtype), x])
    index = conv_window_index(cu_seqlens, num_tokens, width)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(width):   # width (4) gathers of [num_tokens, channels], not one of width times that
        out += rows[index[:, j]].float() * weight[:, j].float()
    # The new state: the inputs at the last width - 1 taps of each sequence's last token.
    last = index[cu_seqlens[1:].long() - 1, 1:]                            # [num_seqs, width - 1]
    new_states = rows[last].transpose(1, 2)
    out = F.silu(out) if activation else out
    return out.to(x.dtype), new_states


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                     activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode). x: [num_seqs, channels]; states: [num_seqs, channels, width - 1]
    -> (silu(conv): [num_seqs, channels], the new states)."""
    window = torch.cat([states.to(x.dtype), x[:, :, None]], dim=-1)       # [num_seqs, channels, width]
    out = (window.float() * weight.float()).sum(-1)
    out = F.silu(out) if activation else out
    return out.to(x.dtype), window[:, :, 1:]


# ---- gated delta rule -------------------------------------------------------------------------

def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepare(q, k, v, num_v_heads: int):
    """fp32, q and k L2-normalised (q also scaled by k_dim ** -0.5) and repeated per value head."""
    q, k, v = q.float(), k.float(), v.float()
    groups = num_v_heads // q.shape[-2]
    q = _l2norm(q).repeat_interleave(groups, dim=-2) * q.shape[-1] ** -0.5
    k = _l2norm(k).repeat_interleave(groups, dim=-2)
    return q, k, v


def gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode). q, k: [num_seqs, num_k_heads, k_dim]; v: [num_seqs, num_v_heads,
    v_dim]; g, beta: [num_seqs, num_v_heads]; state: [num_seqs, num_v_heads, k_dim, v_dim]
    -> (o: [num_seqs, num_v_heads, v_dim] in v's dtype, the new state in fp32)."""
    dtype = v.dtype
    q, k, v = _prepare(q, k, v, v.shape[-2])
    s = state.float() * g.float().exp()[..., None, None]
    delta = (v - torch.einsum("nhkv,nhk->nhv", s, k)) * beta.float()[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", s, q).to(dtype), s


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens after its state, CHUNK tokens at a time. q, k: [num_tokens, num_k_heads,
    k_dim]; v: [num_tokens, num_v_heads, v_dim]; g, beta: [num_tokens, num_v_heads]; state:
    [num_v_heads, k_dim, v_dim] -> (o: [num_tokens, num_v_heads, v_dim] in v's dtype, the new state).

    Within a chunk, with c_t the cumulative log decay from the chunk's start and S0 the state before
    it, the deltas d_t = beta_t (v_t - k_t^T S_{t-1}) solve the unit lower-triangular system
    d_t + sum_{s<t} beta_t exp(c_t - c_s) (k_t . k_s) d_s = beta_t v_t - beta_t exp(c_t) S0^T k_t,
    so a chunk costs two triangular solves and a few matmuls instead of a token-by-token loop."""
    dtype, n = v.dtype, v.shape[0]
    q, k, v = _prepare(q, k, v, v.shape[-2])
    # [heads, tokens, dim], padded to whole chunks (padding: k = v = 0, g = 0, so it changes nothing)
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, -n % CHUNK)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(0, 1), (0, -n % CHUNK)) for x in (g, beta))
    h, length = q.shape[0], q.shape[1]
    q, k, v = (x.view(h, -1, CHUNK, x.shape[-1]) for x in (q, k, v))      # [heads, chunks, CHUNK, dim]
    c = g.view(h, -1, CHUNK).cumsum(-1)                                     # [heads, chunks, CHUNK]
    beta = beta.view(h, -1, CHUNK)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # system[t, s] = beta_t exp(c_t - c_s) (k_t . k_s), strictly below the diagonal
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    system = system.masked_fill(causal.logical_not().logical_or(torch.eye(CHUNK, dtype=torch.bool,
                                                                           device=q.device)), 0.0)
    eye = torch.eye(CHUNK, device=q.device)
    u = torch.linalg.solve_triangular(system + eye, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system + eye, k * (beta * c.exp())[..., None], upper=False,
                                      unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay                              # [heads, chunks, CHUNK, CHUNK]
    s = state.float()
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        d = u[:, i] - w[:, i] @ s                                           # the chunk's deltas
        out[:, i] = (q[:, i] * c[:, i, :, None].exp()) @ s + scores[:, i] @ d
        last = c[:, i, -1:]                                                 # [heads, 1]
        s = s * last.exp()[..., None] + (k[:, i] * (last - c[:, i]).exp()[..., None]).transpose(-1, -2) @ d
    out = out.view(h, length, -1)[:, :n].transpose(0, 1)
    return out.to(dtype), s


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, states: torch.Tensor,
                            cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences back to back (prefill), each after its state. q, k: [num_tokens, num_k_heads, k_dim];
    v: [num_tokens, num_v_heads, v_dim]; g, beta: [num_tokens, num_v_heads]; states: [num_seqs,
    num_v_heads, k_dim, v_dim]; cu_seqlens: host ints [num_seqs + 1] -> (o like v, new states fp32)."""
    outs, new_states = [], []
    for i, (a, b) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        o, s = gated_delta_rule_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[i])
        outs.append(o)
        new_states.append(s)
    return torch.cat(outs), torch.stack(new_states)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x, then times silu(gate), with transformers' roundings (Qwen3_5RMSNormGated).
    x, gate: [..., dim]; weight: [dim]."""
    dtype = x.dtype
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)
