"""transformers' own Qwen4-Exp on the test checkpoint: greedy generation and indexer scores.

The HF model (fp32, eager attention) is the oracle: `greedy` gives its tokens and the
top-1 / top-2 logit margin of each; `indexer_scores` gives, for one sequence, every QSA
layer's group scores (design.md §2.6) computed with HF's own indexer modules from the hidden
states HF feeds them, so the tests can measure the score gap at the top-k boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def load(folder: str, dense: bool = False):
    """The checkpoint in fp32 (eager attention). `dense`: every indexer selects all visible
    tokens (its mask is replaced by the causal one): the same model with dense attention."""
    from transformers import Qwen4ExpForConditionalGeneration

    model = Qwen4ExpForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    if dense:
        for layer in model.model.language_model.layers:
            layer.self_attn.indexer.forward = _select_everything
    return model.eval()


def _select_everything(hidden_states, position_embeddings, attention_mask, past_key_values):
    """An indexer's additive (eager) mask that keeps every causally visible token."""
    return torch.zeros_like(attention_mask)


@dataclass
class Greedy:
    ids: list[int]  # generated ids
    margins: list[float]  # top-1 minus top-2 logit, per generated token
    scale: list[float]  # max |logit|, per generated token
    indexer_inputs: list[tuple]  # per layer: (hidden [1, L + n - 1, H], (cos, sin)) HF fed it


def greedy(model, prompt: list[int], n: int) -> Greedy:
    """Greedy generation of n tokens; records what each indexer saw (prefill and decodes)."""
    lm = model.model.language_model
    captured: dict[int, list] = {i: [] for i in range(len(lm.layers))}

    def hook(i):
        def pre(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos_sin = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            captured[i].append((hidden.detach(), cos_sin))  # cos/sin: every position so far

        return pre

    handles = [
        layer.self_attn.indexer.register_forward_pre_hook(hook(i), with_kwargs=True)
        for i, layer in enumerate(lm.layers)
    ]
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
    finally:
        for h in handles:
            h.remove()
    ids = out.sequences[0, len(prompt):].tolist()
    top2 = [step[0].float().topk(2).values for step in out.logits]
    return Greedy(
        ids, [float(t[0] - t[1]) for t in top2], [float(step[0].abs().max()) for step in out.logits],
        [(torch.cat([h for h, _ in captured[i]], dim=1), captured[i][-1][1]) for i in range(len(lm.layers))],
    )


def indexer_scores(model, run: Greedy) -> list[torch.Tensor]:
    """Per QSA layer, fp32 [L, G] group scores s(t, g) of every row HF ran (prompt and
    decodes: L = prompt + n - 1, G = L // r; NaN where g is not visible to t), from HF's own
    indexer modules on the hidden states HF fed them in `run`."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    scores = []
    for layer, (hidden, (cos, sin)) in zip(model.model.language_model.layers, run.indexer_inputs):
        idx = layer.self_attn.indexer
        L = hidden.shape[1]
        Hi, Di, r = idx.index_n_heads, idx.index_head_dim, idx.compress_ratio
        with torch.no_grad():
            qk = idx.index_qk_proj(hidden)[0]  # [L, (Hi + 1) * Di]
            q = idx.q_layernorm(qk[:, : Hi * Di].view(L, Hi, Di))
            q = apply_rotary_pos_emb(q[None], cos=cos, sin=sin, unsqueeze_dim=2)[0]  # [L, Hi, Di]
            G = L // r
            raw = qk[: G * r, Hi * Di :].view(G, r, Di)
            pooled = idx.k_layernorm(raw.float().mean(1).to(raw.dtype))
            starts = torch.arange(G) * r
            kc = apply_rotary_pos_emb(
                pooled[:, None][None], cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2
            )[0][:, 0]  # [G, Di]
            s = torch.relu(torch.einsum("thd,gd->tgh", q.float(), kc.float())).sum(-1) / Di**0.5
            visible = torch.clamp((torch.arange(L) + 1) // r, max=G)
            s[torch.arange(G)[None, :] >= visible[:, None]] = float("nan")
        scores.append(s)
    return scores
