"""This library as an attention implementation of Hugging Face transformers.

```python
model = AutoModelForCausalLM.from_config(
    config, attn_implementation=attention_multi.integrations.transformers.register()
)
```

``register(name)`` registers two functions under ``name``: the attention
function (``AttentionInterface``) and the mask function
(``AttentionMaskInterface``) that makes what the model hands to it. Without
the second, transformers hands a custom attention no mask at all.

**The mask.** transformers describes each mask as a function of ``(batch,
head, q_idx, kv_idx)`` over absolute positions (causal, sliding window,
chunked, packed sequences from ``position_ids``, bidirectional) and a 2-D
padding mask. ``mask_function`` reads that description once per forward
(not per layer) and turns it into this library's forms: padding into
``valid_lens`` (right padding) or ``segment_ids`` (any other), causality and
sliding windows into ``causal=`` and ``window=``, chunks and packed
sequences into ``segment_ids``, so blocks that no query may see are skipped.
A function it does not recognise (a model's own overlay: image tokens, a
user's ``and_mask_function``) keeps its meaning as a ``mask_mod``, whose block
states are evaluated once per forward into a ``BlockMask`` that every layer
reuses. No dense (Q, K) matrix is made, except for a 4-D mask the caller
made itself, which is passed on as ``mask=`` (boolean) or ``bias=`` (float).

**The attention.** ``attention_function`` takes transformers' arguments:
(batch, heads, Q, d) queries, (batch, kv_heads, K, d) keys and values
(grouped-query heads are not repeated), ``scaling`` (Gemma's
``query_pre_attn_scalar``), ``dropout`` (in training), ``softcap`` (a
``score_mod``), ``s_aux`` (gpt-oss's sinks, ``sinks=``) and
``position_bias`` (``bias=``); it returns (batch, Q, heads, d) and the
weights (batch, heads, Q, K) when ``output_attentions`` asks for them.
Without a mask (a model that made none) causality comes from ``is_causal``
or ``module.is_causal``, aligned as torch's SDPA aligns it (top left: the
keys past the queries are cut, as transformers' ``sdpa`` does).

**The one difference.** A query that may see no key (a left-padded
position, a padding query of an encoder) gives zeros here; transformers'
``eager`` averages the values there and ``sdpa`` gives what the kernel
gives. Every query that sees a key agrees with both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import attention_multi as am

DEFAULT_NAME = "attention_multi"

__all__ = ["DEFAULT_NAME", "Mask", "attention_function", "mask_function", "register"]


def register(name: str = DEFAULT_NAME) -> str:
    """Register this library under ``name`` with transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface``; returns ``name``,
    for ``attn_implementation=``. Registering again is harmless."""
    from transformers import AttentionInterface, AttentionMaskInterface

    if not isinstance(name, str) or not name or name in ("eager", "sdpa"):
        raise ValueError(f"name must be a new attention implementation's name, got {name!r}")
    AttentionInterface.register(name, attention_function)
    AttentionMaskInterface.register(name, mask_function)
    return name


@dataclass(frozen=True)
class Mask:
    """What ``mask_function`` hands the attention of every layer: the keyword
    forms of ``attention_multi.dot_product_attention`` for (batch, Q, K),
    and ``keys``: the keys any query may see are the first ``keys`` (a static
    cache's prefill hands more; None: all). ``shape`` is transformers' 4-D
    mask shape (batch, 1, Q, K)."""

    shape: tuple[int, int, int, int]
    forms: dict[str, Any] = field(default_factory=dict)
    keys: int | None = None
    device: str = "cpu"
    _made: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def ndim(self) -> int:
        return 4

    def placed(self, num_keys: int) -> dict[str, Any]:
        """The forms with ``causal`` and ``window`` written as a ``mask_mod``
        (a ``BlockMask`` made once for every layer): the form a ``score_mod``
        needs when Q != K, where the core asks for one place for a query."""
        if "placed" not in self._made:
            forms = dict(self.forms)
            causal, window = forms.pop("causal", False), forms.pop("window", None)
            batch, _, num_q, _ = self.shape
            shift = num_keys - num_q

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                p = q_idx + shift
                seen = (kv_idx <= p) if causal else (kv_idx >= 0)
                if window is not None:
                    seen = seen & (kv_idx >= p - window[0]) & (kv_idx <= p + window[1])
                return seen

            forms["mask_mod"] = am.block_mask(
                mask_mod, batch, 1, num_q, num_keys, backend="torch", device=self.device
            )
            self._made["placed"] = forms
        return self._made["placed"]


# -- the mask --------------------------------------------------------------------------------

# transformers' mask functions by name (masking_utils): their closures are read, not called
_MODULE = "transformers.masking_utils"


def _parts(fn: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """``fn`` as a conjunction of transformers' named parts: ``[(name, its
    captured values)]``; None where a part is not one of them."""
    if getattr(fn, "__module__", None) != _MODULE:
        return None
    name = fn.__qualname__
    free = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    if name == "and_masks.<locals>.and_mask":
        parts: list[tuple[str, dict[str, Any]]] = []
        for f in free["mask_functions"]:
            sub = _parts(f)
            if sub is None:
                return None
            parts += sub
        return parts
    known = {
        "causal_mask_function": "causal",
        "bidirectional_mask_function": "all",
        "sliding_window_overlay.<locals>.inner_mask": "sliding",
        "sliding_window_bidirectional_overlay.<locals>.inner_mask": "band",
        "chunked_overlay.<locals>.inner_mask": "chunked",
        "packed_sequence_mask_function.<locals>.inner_mask": "packed",
        "remap_positions_for_packed_sequence.<locals>.inner_mask": "remapped",
    }
    if name not in known:
        return None
    return [(known[name], free)]


def _translated(parts, batch, q_len, kv_len, q_offset, kv_offset, padding, xp_device):
    """The forms of a recognised mask, or None when they cannot say it."""
    import torch

    names = [n for n, _ in parts]
    values = {n: v for n, v in parts}
    if len(set(names)) != len(names):
        return None
    if "remapped" in names:  # causal/sliding over position_ids, within packed documents
        inner = _parts(values["remapped"]["mask_function"])
        if inner is None or "packed" not in names:
            return None
        if any(n not in ("causal", "sliding", "all") for n, _ in inner):
            return None  # (translation invariant parts only: the same within a document)
        rest = [(n, v) for n, v in parts if n != "remapped"]
        return _translated(rest + inner, batch, q_len, kv_len, q_offset, kv_offset, padding, None)
    causal = "causal" in names
    shift = q_offset - kv_offset  # query i (at q_offset + i) sees key j when j <= i + shift
    keys = kv_len
    relative = causal or "sliding" in names or "band" in names
    if relative:
        if causal and shift < kv_len - q_len:  # (keys past the last query's: no query sees them)
            keys = q_len + shift
        if keys - q_len != shift or keys <= 0:
            return None
    forms: dict[str, Any] = {}
    if causal:
        forms["causal"] = True
    if "sliding" in names:  # kv > q - w: w keys up to the query's own
        if not causal:
            return None
        forms["window"] = (int(values["sliding"]["sliding_window"]) - 1, 0)
    if "band" in names:  # |q - kv| <= w
        w = int(values["band"]["sliding_window"])
        forms["window"] = (w, w)
    device = None if padding is None else padding.device
    q_ids = k_ids = None
    if "chunked" in names and "packed" in names:
        return None
    if "chunked" in names:
        size, left = int(values["chunked"]["chunk_size"]), values["chunked"]["left_padding"]
        device = left.device
        left = left.reshape(-1, 1)
        shift = left // size + 1  # (ids from 0: negative ids are padding)
        q_pos = torch.arange(q_len, device=device) + q_offset
        k_pos = torch.arange(keys, device=device) + kv_offset
        q_ids = (torch.div(q_pos - left, size, rounding_mode="floor") + shift).expand(batch, q_len)
        k_ids = (torch.div(k_pos - left, size, rounding_mode="floor") + shift).expand(batch, keys)
    if "packed" in names:
        ids = values["packed"]["packed_sequence_mask"]
        if ids.shape[-1] != q_len or q_len != keys or kv_offset or q_offset:
            return None
        q_ids = k_ids = ids.expand(batch, q_len)
    if padding is not None:
        padding = padding[:, :keys]
        if bool(padding.all()):
            padding = None
    if padding is not None:
        lens = padding.sum(-1)
        prefix = bool(
            (padding == (torch.arange(keys, device=padding.device) < lens[:, None])).all()
        )
        if k_ids is None and prefix:
            forms["valid_lens"] = lens.to(torch.int32)
        else:
            if k_ids is None:
                q_ids = torch.zeros((batch, q_len), dtype=torch.int32, device=padding.device)
                k_ids = torch.zeros((batch, keys), dtype=torch.int32, device=padding.device)
            k_ids = torch.where(padding, k_ids, -1)
    if k_ids is not None:
        forms["segment_ids"] = (q_ids.to(torch.int32), k_ids.to(torch.int32))
    return forms, (None if keys == kv_len else keys)


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: Any = None,
    allow_is_bidirectional_skip: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> Mask | None:
    """transformers' mask interface (``AttentionMaskInterface``): the
    ``Mask`` of one forward, from transformers' ``mask_function`` (absolute
    positions: query ``i`` at ``q_offset + i``, key ``j`` at ``kv_offset +
    j``) and the 2-D ``attention_mask`` (True: a real token). None for a
    bidirectional mask without padding when transformers allows skipping it."""
    import torch
    from transformers import masking_utils

    if isinstance(attention_mask, Mask):  # (made already: generate makes a static cache's first)
        return attention_mask
    fn = masking_utils.causal_mask_function if mask_function is None else mask_function
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # (a static cache's: a tensor)
    padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)
        if padding.shape[0] != batch_size:
            padding = padding.expand(batch_size, -1)
    shape = (batch_size, 1, q_length, kv_length)
    parts = _parts(fn)
    if parts is not None:
        found = _translated(
            parts, batch_size, q_length, kv_length, q_offset, kv_offset, padding, device
        )
        if found is not None:
            forms, keys = found
            if allow_is_bidirectional_skip and not forms and keys is None:
                return None
            return Mask(shape, forms, keys, device=str(device))
    # Any other function: a mask_mod over its block states, evaluated once for every layer
    forms = {}
    if padding is not None and not bool(padding.all()):
        forms["segment_ids"] = (
            torch.zeros((batch_size, q_length), dtype=torch.int32, device=padding.device),
            torch.where(padding, 0, -1).to(torch.int32),
        )

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return fn(b, h, q_idx + q_offset, kv_idx + kv_offset)

    forms["mask_mod"] = am.block_mask(
        mask_mod, batch_size, 1, q_length, kv_length, backend="torch", device=str(device)
    )
    return Mask(shape, forms, device=str(device))


# -- the attention ---------------------------------------------------------------------------


def attention_function(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """transformers' attention interface (``AttentionInterface``):
    ``query`` (batch, heads, Q, d), ``key`` and ``value`` (batch, kv_heads,
    K, d), ``attention_mask`` a ``Mask`` (``mask_function``'s), a 4-D
    tensor or None. Returns ``(output (batch, Q, heads, d), weights or
    None)``: the weights (batch, heads, Q, K) when ``output_attentions``."""
    import torch

    num_q, num_k = query.shape[2], key.shape[2]
    if isinstance(attention_mask, Mask):
        if attention_mask.shape[-1] != num_k:
            raise ValueError(
                f"the mask was made for {attention_mask.shape[-1]} keys, the attention got "
                f"{num_k} (key {tuple(key.shape)})"
            )
        forms = dict(attention_mask.forms)
        keys = attention_mask.keys
    elif attention_mask is None:
        forms, keys = {}, None
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and num_q > 1:  # (torch's is_causal: aligned top left, as sdpa)
            forms["causal"] = True
            keys = num_q if num_k > num_q else None
    elif isinstance(attention_mask, torch.Tensor):  # a 4-D mask made by the caller
        mask = attention_mask[..., :num_k]
        forms = {"mask": mask} if mask.dtype == torch.bool else {"bias": mask.to(query.dtype)}
        keys = None
    else:
        raise TypeError(
            f"attention_mask must be what attention_multi's mask function makes (register() "
            f"registers it), a 4-D tensor or None, got {type(attention_mask).__name__}"
        )
    softcap = kwargs.get("softcap")
    bias = kwargs.get("position_bias")
    if bias is not None:
        if "bias" in forms:
            forms["bias"] = forms["bias"] + bias
        else:
            forms["bias"] = bias
    if softcap is not None:
        forms["score_mod"] = _softcapped(float(softcap), forms.pop("bias", None))
    sinks = kwargs.get("s_aux")
    k, v = (key, value) if keys is None else (key[:, :, :keys], value[:, :, :keys])
    placed = "causal" in forms or "window" in forms
    if "score_mod" in forms and placed and k.shape[2] != num_q:
        if not isinstance(attention_mask, Mask):
            attention_mask = Mask((query.shape[0], 1, num_q, num_k), forms, keys, str(query.device))
        forms = {**attention_mask.placed(k.shape[2]), "score_mod": forms["score_mod"]}
    dropout = float(dropout) if getattr(module, "training", False) else 0.0
    options = {"scale": scaling, "sinks": sinks, **forms}
    if not kwargs.get("output_attentions"):
        out: Any = am.dot_product_attention(query, k, v, dropout=dropout, **options)
        return out.transpose(1, 2), None
    # the weights: the attention of the identity as values (the same forms, no dropout)
    eye = torch.eye(k.shape[2], dtype=query.dtype, device=query.device)
    weights: Any = am.dot_product_attention(
        query, k, eye.expand(k.shape[0], k.shape[1], -1, -1), **options
    )
    if dropout:
        weights = torch.nn.functional.dropout(weights, dropout)
    groups = query.shape[1] // k.shape[1]
    out = torch.matmul(weights, v.repeat_interleave(groups, dim=1) if groups > 1 else v)
    if keys is not None:
        weights = torch.nn.functional.pad(weights, (0, num_k - keys))
    return out.transpose(1, 2), weights


def _softcapped(cap: float, bias: Any) -> Any:
    """Gemma's soft-capping as a ``score_mod`` (a float mask added after it, as eager does)."""
    import torch

    if bias is None:

        def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return torch.tanh(score / cap) * cap

        return softcap
    table = bias.expand(bias.shape[0], bias.shape[1], bias.shape[2], bias.shape[3])

    def softcap_then_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        hb = h if table.shape[1] > 1 else h * 0
        return torch.tanh(score / cap) * cap + table[b, hb, q_idx, kv_idx]

    return softcap_then_bias
