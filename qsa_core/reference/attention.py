"""Reference of the sparse paged attention: GQA over each row's selected tokens, gated."""

from __future__ import annotations

import torch

# Cap on the fp32 scratch (logits and probabilities) of one chunk of rows (bytes).
SCRATCH_BYTES = 256 << 20


def qsa_sparse_attention(
    q: torch.Tensor,
    gate: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    selection: torch.Tensor,
    *,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """out [T, Hq*D] (q.dtype) = dtype(softmax(q.k * scale) v) * sigmoid(gate), fp32 math.

    q, gate [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D] (any strides, fp8 with
    per-tensor k_scale / v_scale allowed); selection int32 [T, W + 1] with the count in the
    last column. Entries < 0 or >= the request's seq_len are ignored; a row with none left
    is exactly 0 whatever its gate holds.
    """
    T, Hq, D = q.shape
    W = selection.shape[1] - 1
    out = torch.zeros(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out.view(T, Hq * D)
    req = token_to_req.long()
    cols = torch.arange(W, device=q.device)[None, :]
    bytes_per_col = Hq * 12 + 16  # logits, bias and probabilities per head; counts, indices
    for r in torch.unique(req).tolist():
        rows = (req == r).nonzero().flatten()
        seq_len = int(seq_lens[r])
        chunk = max(1, SCRATCH_BYTES // (max(seq_len, W) * bytes_per_col))
        for i in range(0, rows.numel(), chunk):
            part = rows[i : i + chunk]
            idx = selection[part, :W].long()
            valid = (idx >= 0) & (idx < seq_len) & (cols < selection[part, W:].long())
            live = valid.any(1)
            if not live.any():
                continue
            part, idx, valid = part[live], idx[live], valid[live]
            out[part] = _attend_request_rows(
                q[part], gate[part], k_cache, v_cache, block_table[r], idx, valid, seq_len,
                softmax_scale * k_scale, v_scale,
            )
    return out.view(T, Hq * D)


def _attend_request_rows(
    q: torch.Tensor,
    gate: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages_of_request: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor,
    seq_len: int,
    scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Rows [n] of one request, each with at least one valid entry -> gated output [n, Hq, D].

    The K/V of the union U of the rows' selected tokens are gathered once; each row then
    attends to all of U with log(multiplicity) added to its logits (-inf where a token is
    not in its selection), which equals attending to its own list, duplicates included.
    """
    n, Hq, D = q.shape
    Hkv, page = k_cache.shape[2], k_cache.shape[1]
    G = Hq // Hkv
    counts = torch.zeros(n, seq_len + 1, device=q.device)
    counts.scatter_add_(1, torch.where(valid, idx, seq_len), valid.float())
    used = counts[:, :seq_len].any(0).nonzero().flatten()  # U, ascending positions
    counts = counts[:, used]
    bias = torch.where(counts > 0, counts.log(), -torch.inf)  # [n, U]
    pages = pages_of_request.long()[used // page].clamp(min=0)
    k = k_cache[pages, used % page].float()  # [U, Hkv, D]
    v = v_cache[pages, used % page].float()
    if n > 1 and not (k.isfinite().all() and v.isfinite().all()):
        # A non-finite K or V must reach only the rows that select it, and in the shared GEMM
        # a zero probability times NaN is NaN: such a request attends row by row.
        return torch.cat([
            _attend_request_rows(q[i : i + 1], gate[i : i + 1], k_cache, v_cache, pages_of_request,
                                 idx[i : i + 1], valid[i : i + 1], seq_len, scale, v_scale)
            for i in range(n)
        ])
    qf = (q.float() * scale).view(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D)
    logits = torch.bmm(qf, k.permute(1, 2, 0)).view(Hkv, n, G, -1)  # [Hkv, n, G, U]
    logits.add_(bias[None, :, None, :])
    probs = torch.softmax(logits, dim=-1).view(Hkv, n * G, -1)
    o = torch.bmm(probs, v.transpose(0, 1)).view(Hkv, n, G, D).transpose(0, 1).reshape(n, Hq, D)
    return ((o * v_scale).to(q.dtype).float() * torch.sigmoid(gate.float())).to(q.dtype)
