"""Handlers: products (``F.linear``, ``matmul``/``@``, ``einsum``) and attention
(``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``).

Local when the sharded dim is not contracted; a contraction over it in both operands gives the
global, Replicated sum; two bands where the result keeps one operand's rows gather the other.
SDPA with at least as many heads as ranks runs Ulysses-style (one all-to-all each way).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mpidp.ops.attention import attention_over_key_band, causal_rows, mha_rows_mask
from mpidp.ops.collectives import all_gather_v
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.dispatch import first_sharded, refuse, register
from mpidp.sharded.partial import partial_sum
from mpidp.sharded.rows import move_to_dim, to_spec
from mpidp.sharded.shapes import _plain, _wrap
from mpidp.sharded.tensor import ShardedTensor, replicated

__all__: list[str] = []


# -- products over unsharded dims ---------------------------------------------------------------


@register(F.linear, blocks=True)
def _linear(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Over other dims the batch rule runs it locally (mpidp.sharded.batch); here: over the
    sharded dim (a global head on a flattened field: ``Conv2d -> Flatten -> Linear``), where
    the band may hold blocks (the channels merged before it). Each rank multiplies its
    entries by the weight's matching columns: a partial sum, summed once when needed (the
    bias added to the value). A sharded weight is refused."""
    names = ("input", "weight", "bias")
    a = dict(zip(names, args, strict=False))
    a.update(kwargs)
    x, weight, bias = a["input"], a["weight"], a.get("bias")
    if (
        not isinstance(x, ShardedTensor)
        or isinstance(weight, ShardedTensor)
        or isinstance(bias, ShardedTensor)
        or x.shard_dim != x.dim() - 1
    ):
        raise refuse(
            func, args, kwargs, "a linear map with a sharded weight or bias",
            "keep the weight whole (a parameter); shard the input",
        )  # fmt: skip
    t = x.transport
    w = x.rows_of(_plain(weight, t), 1)  # this rank's columns (its rows of every block)
    out = partial_sum(torch.matmul(x.local, w.transpose(0, 1)), t)
    return out if bias is None else out + bias


def whole(x: ShardedTensor) -> torch.Tensor:
    """``x`` gathered on every rank for a computation that differs by rank (the partial
    rule: the backward sums every rank's gradient and hands each band its rows)."""
    return all_gather_v(x.local, list(x.spec.sizes), x.shard_dim, group=x.transport)


@register(
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.mm,
    torch.bmm,
    torch.Tensor.mm,
    torch.Tensor.bmm,
    blocks=True,
)
def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) != 2 or kwargs:
        raise refuse(func, args, kwargs, "a product of other than two tensors", "pass two")
    a, b = args[0], args[1]
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    out_ndim = max(a.dim(), b.dim())
    ok = True
    if isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor):
        na, nb = a.dim(), b.dim()
        if (
            a.shard_dim < na - 2 and na - a.shard_dim == nb - b.shard_dim and a.blocks == b.blocks
        ):  # a batch dim of both
            b = to_spec(b, a.spec)
        elif a.blocks > 1 or b.blocks > 1:
            ok = False
        elif a.shard_dim == na - 2 and nb >= 2:  # a's rows: b whole on every rank (k, v)
            b = whole(b)
        elif nb >= 2 and b.shard_dim == nb - 1 and na >= 2:  # b's columns: a whole
            a = whole(a)
        elif a.shard_dim == na - 1 and nb >= 2 and b.shard_dim == nb - 2:  # both contracted
            t = a.transport
            return partial_sum(torch.matmul(a.local, to_spec(b, a.spec).local), t)
        else:
            ok = False
    elif isinstance(a, ShardedTensor):
        if a.shard_dim == a.dim() - 1 and b.dim() >= 1:  # a contraction over the band
            t = a.transport
            w = a.rows_of(_plain(b, t), 0 if b.dim() == 1 else b.dim() - 2)
            return partial_sum(torch.matmul(a.local, w), t)
        ok = a.shard_dim != a.dim() - 1 and a.dim() >= 2
        ok = ok and (a.blocks == 1 or a.shard_dim < a.dim() - 2)
    else:
        if b.dim() >= 2 and b.shard_dim == b.dim() - 2:  # a contraction over the band, b right
            t = b.transport  # (torch-harmonics' DISCO: psi @ field flattened to (lat x lon))
            w = _plain(a, t)
            if w.is_sparse and b.blocks == 1:  # (DISCO's filter: sparse COO, no narrow)
                rows = torch.arange(b.start, b.start + b.local.size(b.shard_dim))
                w = w.index_select(w.dim() - 1, rows.to(w.device))
            else:
                w = b.rows_of(w, w.dim() - 1)
            prod = (torch.bmm if w.dim() == 3 else torch.mm) if w.is_sparse else torch.matmul
            return partial_sum(prod(w, b.local), t)
        ok = b.dim() >= 2 and b.shard_dim != b.dim() - 2
        ok = ok and (b.blocks == 1 or b.shard_dim < b.dim() - 2)
    ref = first_sharded((a, b))
    t = ref.transport
    if not ok:
        raise refuse(
            func,
            args,
            kwargs,
            "a product that contracts the sharded dim (or two bands of different rows)",
            "contract other dims, or gather one side (full_tensor())",
        )
    x = ref
    axis = out_ndim - x.dim() + x.shard_dim
    if b.dim() == 1 and x is a:
        axis = x.shard_dim  # the last dim is dropped, the sharded dim is before it

    def band_of(op: Any) -> torch.Tensor:
        if isinstance(op, ShardedTensor):
            return op.local
        op = _plain(op, t)
        i = op.dim() - (x.dim() - x.shard_dim)  # the plain operand's dim beside the bands'
        if op.dim() > 2 and i >= 0 and i < op.dim() - 2 and op.size(i) != 1:
            if op.size(i) != x.size(x.shard_dim):
                raise refuse(
                    func,
                    args,
                    kwargs,
                    f"a plain operand of shape {tuple(op.shape)} has {op.size(i)} entries "
                    f"along the batch dim the bands are cut along ({x.size(x.shard_dim)} rows)",
                    "pass the global length or 1 there",
                )
            op = x.rows_of(op, i)
        return op

    return _wrap(x, torch.matmul(band_of(a), band_of(b)), axis)


def _expand_ellipsis(eq: str, ops: Sequence[Any]) -> str:
    """``eq`` with each '...' spelled out in letters the equation does not use (right-aligned
    broadcasting dims, as torch aligns them)."""
    if "..." not in eq and "->" in eq:
        return eq
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    widths = [op.dim() - len(term.replace("...", "")) for term, op in zip(terms, ops, strict=True)]
    most = max((w for t, w in zip(terms, widths, strict=True) if "..." in t), default=0)
    fill = "".join(spare[:most])
    terms = [t.replace("...", fill[most - w :]) for t, w in zip(terms, widths, strict=True)]
    if arrow:
        rhs = rhs.replace("...", fill)
    else:
        counted = "".join(t for t in terms)
        rhs = fill + "".join(sorted(c for c in set(counted) - set(fill) if counted.count(c) == 1))
    return ",".join(terms) + "->" + rhs


@register(torch.einsum)
def _einsum(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = _expand_ellipsis(args[0].replace(" ", ""), ops)
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    # the bands of the result: an operand's whose sharded letter the result keeps (q's rows
    # in "bhid,bhjd->bhij"); operands sharded along another letter are gathered whole (k)
    sharded = [(i, o) for i, o in enumerate(ops) if isinstance(o, ShardedTensor)]
    kept = [(i, o) for i, o in sharded if terms[i][o.shard_dim] in rhs]
    at, ref = (kept or sharded)[0]
    letter = terms[at][ref.shard_dim]
    t = ref.transport
    local_ops = []
    for term, op in zip(terms, ops, strict=True):
        if isinstance(op, ShardedTensor):
            if term[op.shard_dim] != letter or op.spec.total != ref.spec.total:
                local_ops.append(whole(op))
                continue
            local_ops.append(to_spec(op, ref.spec).local)
        else:
            op = _plain(op, t)
            if letter in term and op.size(term.index(letter)) == ref.spec.total:
                op = ref.rows_of(op, term.index(letter))
            elif letter in term and op.size(term.index(letter)) != 1:
                raise refuse(
                    func,
                    args,
                    kwargs,
                    "a plain operand of another length along the sharded letter",
                    "pass the global length",
                )
            local_ops.append(op)
    out = torch.einsum(f"{lhs}->{rhs}", *local_ops)
    if letter in rhs:
        return _wrap(ref, out, rhs.index(letter))
    return partial_sum(out, t)


def _ulysses(
    func: Any, q: ShardedTensor, k: Any, v: Any, a: dict[str, Any]
) -> ShardedTensor | None:
    """DeepSpeed-Ulysses on uneven cuts: one all-to-all each takes q, k and v from
    sequence-cut to head-cut (7 heads over 4 ranks: 2, 2, 2, 1), every rank attends its heads
    over the whole sequence with torch's kernel, one all-to-all takes the result back to q's
    rows. K and V are never whole on a rank. None when it does not apply (fewer heads than
    ranks, grouped-query heads, keys not cut along the sequence, a mask cut into bands):
    then the keys and values are gathered instead."""
    p, n = q.spec.parts, q.dim()
    mask = a.get("attn_mask")
    if (
        n != 4
        or q.shape[1] < p
        or not all(isinstance(z, ShardedTensor) and z.shard_dim == n - 2 for z in (k, v))
        or k.shape[1] != q.shape[1]
        or isinstance(mask, ShardedTensor)
    ):
        return None
    heads = ShardSpec.balanced(q.shape[1], p)
    qh, kh, vh = (move_to_dim(z, 1, heads) for z in (q, k, v))
    if isinstance(mask, torch.Tensor):
        mask = _plain(mask, q.transport)
        if mask.dim() == 4 and mask.size(1) == q.shape[1] and q.shape[1] != 1:
            mask = mask.narrow(1, heads.start(q.rank), heads.sizes[q.rank])
    kw = {**a, "attn_mask": mask}
    y = ShardedTensor(func(qh.local, kh.local, vh.local, **kw), heads, 1, q.manager)
    return move_to_dim(y, n - 2, q.spec)


@register(F.scaled_dot_product_attention)
def _sdpa(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Attention with the queries cut along the sequence (dim -2): every rank gathers the keys
    and values whole and attends its own queries to all of them (exact: torch's kernel on
    every query row; K and V whole on every rank, the attention matrix only for its rows). An
    additive or boolean mask of the global (L, S) shape is cut to the rows; ``is_causal``
    becomes the mask of the rows' global positions. Queries cut along a batch or head dim
    (keys and values cut the same way) attend locally."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    a = dict(zip(names, args, strict=False))
    a.update(kwargs)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    if not isinstance(q, ShardedTensor):
        return _whole_queries(func, args, kwargs, q, k, v, a)
    t, n = q.transport, q.dim()
    if q.shard_dim < n - 2:  # heads or batch: independent problems
        k2, v2 = (to_spec(z, q.spec).local if isinstance(z, ShardedTensor) else z for z in (k, v))
        mask = a.get("attn_mask")
        if isinstance(mask, ShardedTensor):
            a["attn_mask"] = to_spec(mask, q.spec).local
        return _wrap(q, func(q.local, k2, v2, **a), q.shard_dim)
    if q.shard_dim != n - 2:
        raise refuse(func, args, kwargs, "queries cut along the head dim size", "cut the sequence")
    ulysses = _ulysses(func, q, k, v, a)
    if ulysses is not None:
        return ulysses
    k2, v2 = (whole(z) if isinstance(z, ShardedTensor) else _plain(z, t) for z in (k, v))
    rows, start = q.spec.sizes[q.rank], q.start
    mask = a.get("attn_mask")
    if isinstance(mask, ShardedTensor):
        mask = to_spec(mask, q.spec).local if mask.shard_dim == mask.dim() - 2 else whole(mask)
    elif isinstance(mask, torch.Tensor):
        mask = _plain(mask, t)
        if mask.dim() >= 2 and mask.size(-2) == q.spec.total and q.spec.total != 1:
            mask = mask.narrow(-2, start, rows)
    if a.pop("is_causal", False):
        ids = torch.arange(start, start + rows, device=q.local.device)
        mask = causal_rows(ids, k2.size(-2), mask)
    a["attn_mask"] = mask
    return _wrap(q, func(q.local, k2, v2, **a), q.shard_dim)


def _whole_queries(
    func: Any, args: Any, kwargs: Any, q: Any, k: Any, v: Any, a: dict[str, Any]
) -> Any:
    """Queries every rank holds whole (learned latents, a pooled token) against keys and
    values cut along the sequence: :func:`mpidp.ops.attention.attention_over_key_band` (split
    softmax merged exactly; the keys never move). The result is the same on every rank."""
    if not isinstance(k, ShardedTensor) or k.shard_dim != k.dim() - 2:
        raise refuse(
            func, args, kwargs, "the values are cut but neither the queries nor the keys' sequence",
            "cut the keys and values along the sequence (dim -2), or the queries too",
        )  # fmt: skip
    if a.get("enable_gqa", False):
        raise refuse(
            func, args, kwargs, "grouped-query heads with whole queries over a band of keys",
            "repeat the key and value heads to the queries' (repeat_interleave)",
        )  # fmt: skip
    t = k.transport
    if isinstance(v, ShardedTensor):
        if v.shard_dim != v.dim() - 2:
            raise refuse(func, args, kwargs, "values cut along another dim", "cut them as keys")
        v = to_spec(v, k.spec).local
    else:  # the whole values: this rank's rows (its share of their gradient)
        v = _plain(v, t).narrow(-2, k.start, k.spec.sizes[k.rank])
    mask = a.get("attn_mask")
    mask = whole(mask) if isinstance(mask, ShardedTensor) else _plain(mask, t)
    out = attention_over_key_band(
        _plain(q, t), k.local, v, k.start, k.spec.total, t, mask,
        bool(a.get("is_causal", False)), a.get("scale"), dropout_p=float(a.get("dropout_p", 0.0)),
    )  # fmt: skip
    return replicated(out, t)


_MHA_ARGS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


@register(F.multi_head_attention_forward)
def _mha(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nn.MultiheadAttention`` with the queries cut along the sequence (dim 0 of the
    ``(L, B, E)`` or ``(L, E)`` torch's module passes): the keys and values are gathered whole
    and each rank attends its queries to all of them with torch's code (as the converted
    module does; exact for any heads, masks, ``bias_k``, ``need_weights``). Masks of the
    global shapes are cut to the rows; output and weights are cut along L."""
    a = dict(zip(_MHA_ARGS, args, strict=False))
    a.update(kwargs)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    if not isinstance(q, ShardedTensor) and isinstance(k, ShardedTensor) and k.shard_dim == 0:
        return _mha_whole_queries(func, args, kwargs, q, k, v, a)
    if not isinstance(q, ShardedTensor) or q.shard_dim != 0:
        raise refuse(func, args, kwargs, "queries not cut along the sequence", "cut the tokens")
    t = q.transport
    k2 = whole(k) if isinstance(k, ShardedTensor) else _plain(k, t)
    v2 = k2 if v is k else whole(v) if isinstance(v, ShardedTensor) else _plain(v, t)
    kpm = a.get("key_padding_mask")
    kpm = whole(kpm) if isinstance(kpm, ShardedTensor) else _plain(kpm, t)
    a["key_padding_mask"] = kpm
    mask = a.get("attn_mask")
    mask = whole(mask) if isinstance(mask, ShardedTensor) else _plain(mask, t)
    extra = a.get("bias_k") is not None or a.get("add_zero_attn") or a.get("static_k") is not None
    a["attn_mask"] = mha_rows_mask(
        mask, kpm, q.spec, q.rank, k2.size(0), func.__name__,
        is_causal=bool(a.get("is_causal")), need_weights=bool(a.get("need_weights", True)),
        extra_keys=extra,
    )  # fmt: skip
    a["is_causal"] = False
    a = {n: _plain(z, t) for n, z in a.items()}
    out, weights = func(q.local, k2, v2, **a)
    return _wrap(q, out, 0), None if weights is None else _wrap(q, weights, weights.dim() - 2)


def _mha_whole_queries(
    func: Any, args: Any, kwargs: Any, q: Any, k: ShardedTensor, v: Any, a: dict[str, Any]
) -> Any:
    """``nn.MultiheadAttention`` with queries every rank holds whole (learned latents) and keys
    and values cut along the sequence: torch's projections on each rank's keys, then
    :func:`mpidp.ops.attention.attention_over_key_band` per head (the keys never move), then the
    output projection. The output is the same on every rank; the attention weights (when
    asked for) are a band along the keys, after dropout as torch returns them (each rank's
    columns dropped from its band stream). Extra keys (``bias_k``, ``add_zero_attn``) and
    static keys are refused."""
    if a.get("bias_k") is not None or a.get("add_zero_attn") or a.get("static_k") is not None:
        raise refuse(
            func, args, kwargs, "extra keys (bias_k, add_zero_attn) or static keys with whole "
            "queries over a band of keys", "leave them out, or cut the queries along the "
            "sequence too",
        )  # fmt: skip
    dropout = float(a.get("dropout_p") or 0.0) if a.get("training", True) else 0.0
    t = k.transport
    q = _plain(q, t)
    batched = q.dim() == 3  # (L, N, E); unbatched (L, E)
    heads, e = int(a["num_heads"]), q.size(-1)
    hd = e // heads
    if a.get("use_separate_proj_weight"):
        wq, wk, wv = (_plain(a[n], t) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
    else:
        wq, wk, wv = _plain(a["in_proj_weight"], t).chunk(3)
    bias = a.get("in_proj_bias")
    bq, bk, bv = _plain(bias, t).chunk(3) if bias is not None else (None, None, None)
    rows = k.spec.sizes[k.rank]
    kl = k.local
    vl = (
        to_spec(v, k.spec).local
        if isinstance(v, ShardedTensor)
        else _plain(v, t).narrow(0, k.start, rows)
    )
    qp, kp, vp = F.linear(q, wq, bq), F.linear(kl, wk, bk), F.linear(vl, wv, bv)
    if not batched:
        qp, kp, vp = qp.unsqueeze(1), kp.unsqueeze(1), vp.unsqueeze(1)
    n = qp.size(1)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # (len, N, E) -> (N, heads, len, hd)
        return x.reshape(x.size(0), n, heads, hd).permute(1, 2, 0, 3)

    bias_mask = _mha_bias(a, k, n, heads, qp.size(0), q)
    out, probs = attention_over_key_band(
        heads_first(qp), heads_first(kp), heads_first(vp), k.start, k.spec.total, t,
        bias_mask, False, None, weights=True, dropout_p=dropout,
    )  # fmt: skip
    # the output projection acts on a value every rank holds: the Replicated rule gives its
    # parameters their shares (rank 0's whole, mpidp's convention) or whole gradients
    out = replicated(out.permute(2, 0, 1, 3).reshape(qp.size(0), n, e), t)
    out = F.linear(out, a["out_proj_weight"], a.get("out_proj_bias"))
    out = out if batched else out.squeeze(1)
    if not a.get("need_weights", True):
        return out, None
    if a.get("average_attn_weights", True):
        probs = probs.mean(dim=1)  # (N, L, S_r)
    probs = probs if batched else probs.squeeze(0)
    return out, ShardedTensor(probs, k.spec, probs.dim() - 1, k.manager)


def _mha_bias(
    a: dict[str, Any], k: ShardedTensor, n: int, heads: int, length: int, like: torch.Tensor
) -> torch.Tensor | None:
    """``key_padding_mask`` (N, S) and ``attn_mask`` ((L, S) or (N * heads, L, S)) of the global
    key length as one additive bias broadcasting to (N, heads, L, S) (cut to each rank's keys
    by the attention); True in a boolean mask is a key NOT attended (torch's MHA convention)."""
    t = k.transport

    def additive(m: Any) -> torch.Tensor | None:
        if m is None:
            return None
        m = whole(m) if isinstance(m, ShardedTensor) else _plain(m, t)
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=like.dtype).masked_fill(m, -torch.inf)
        return m.to(like.dtype)

    kpm, mask = additive(a.get("key_padding_mask")), additive(a.get("attn_mask"))
    out = None
    if kpm is not None:
        out = kpm.reshape(n, 1, 1, -1)
    if mask is not None:
        mask = (
            mask.reshape(1, 1, length, -1)
            if mask.dim() == 2
            else mask.reshape(n, heads, length, -1)
        )
        out = mask if out is None else out + mask
    return out
