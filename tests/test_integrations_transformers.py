"""attention_multi.integrations.transformers inside Hugging Face transformers'
models (tiny random-weight configs, nothing downloaded): logits and gradients
against transformers' own ``sdpa`` (``eager`` where sdpa refuses the model:
soft-capping, sinks), ``generate``, the mask forms each of transformers' mask
functions becomes, weights, dropout, bfloat16."""

import copy
import subprocess
import sys

import numpy as np
import pytest

from conftest import import_or_skip

tf = import_or_skip("transformers")
torch = import_or_skip("torch")

from transformers import masking_utils  # noqa: E402

import attention_multi as am  # noqa: E402
from attention_multi.integrations import transformers as amt  # noqa: E402

TOL = 2e-5
NAME = amt.register()
SMALL = dict(
    vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)


def family(name):
    """(config, auto class, the implementation to compare with)."""
    causal = tf.AutoModelForCausalLM
    if name == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **SMALL), causal, "sdpa"
    if name == "mistral":
        return tf.MistralConfig(num_key_value_heads=2, sliding_window=4, **SMALL), causal, "sdpa"
    if name == "qwen2":  # a sliding layer, then a full one
        cfg = tf.Qwen2Config(
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            layer_types=["sliding_attention", "full_attention"],
            **SMALL,
        )
        return cfg, causal, "sdpa"
    if name == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        return cfg, causal, "sdpa"
    if name == "bert":
        cfg = tf.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64,
        )  # fmt: skip
        return cfg, tf.AutoModelForMaskedLM, "sdpa"
    if name == "gemma2":  # query_pre_attn_scalar, soft-capping (sdpa refuses it)
        cfg = tf.Gemma2Config(
            num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
            attn_logit_softcapping=0.2, sliding_window=4, **SMALL,
        )  # fmt: skip
        return cfg, causal, "eager"
    if name == "gpt_oss":  # sinks (s_aux; sdpa ignores them)
        cfg = tf.GptOssConfig(
            num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
            sliding_window=4, **SMALL,
        )  # fmt: skip
        return cfg, causal, "eager"
    raise AssertionError(name)


FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "bert", "gemma2", "gpt_oss")


def pair(name, dtype=torch.float32):
    cfg, auto, base = family(name)
    torch.manual_seed(0)
    theirs = auto.from_config(copy.deepcopy(cfg), attn_implementation=base).eval().to(dtype)
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval().to(dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def padding(side, batch=3, length=11):
    m = torch.ones(batch, length, dtype=torch.long)
    if side == "right":
        m[0, 6:], m[1, 3:] = 0, 0
    elif side == "left":
        m[0, :3], m[1, :6] = 0, 0
    return m


def grads(model, logits, keep):
    loss = logits[keep].square().mean()
    return torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)


@pytest.mark.parametrize("side", ["right", "left", "none"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_gradients(name, side):
    theirs, ours = pair(name)
    ids = torch.randint(3, 100, (3, 11), generator=torch.Generator().manual_seed(1))
    m = padding(side)
    want, got = theirs(ids, attention_mask=m).logits, ours(ids, attention_mask=m).logits
    keep = m.bool()  # (a padded query sees no key in left padding: zeros here, see the guide)
    assert (want - got)[keep].abs().max().item() <= TOL
    pairs = [
        (a, b) for a, b in zip(grads(theirs, want, keep), grads(ours, got, keep)) if a is not None
    ]
    assert pairs
    assert max((a - b).abs().max().item() for a, b in pairs) <= TOL


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_generate_same_tokens(name, cache):
    theirs, ours = pair(name)
    ids = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(2))
    m = padding("left", 3, 7)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    assert torch.equal(
        theirs.generate(ids, attention_mask=m, **kw), ours.generate(ids, attention_mask=m, **kw)
    )


def test_packed_sequences_from_position_ids():
    theirs, ours = pair("llama")
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(12))])
    want, got = theirs(ids, position_ids=pos).logits, ours(ids, position_ids=pos).logits
    assert (want - got).abs().max().item() <= TOL


def test_output_attentions_against_eager():
    cfg, auto, _ = family("llama")
    torch.manual_seed(0)
    eager = auto.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    ids, m = torch.randint(3, 100, (3, 11)), padding("right")
    want = eager(ids, attention_mask=m, output_attentions=True)
    got = ours(ids, attention_mask=m, output_attentions=True)
    assert len(got.attentions) == 2
    for a, b in zip(want.attentions, got.attentions):
        assert a.shape == b.shape == (3, 4, 11, 11)
        assert (a - b).abs().max().item() <= TOL
    assert (want.logits - got.logits).abs().max().item() <= TOL


def test_dropout_in_training():
    cfg, auto, _ = family("llama")
    cfg.attention_dropout = 0.5
    torch.manual_seed(0)
    ours = auto.from_config(cfg, attn_implementation=NAME)
    ids, m = torch.randint(3, 100, (2, 9)), padding("right", 2, 9)
    ours.eval()
    quiet = ours(ids, attention_mask=m).logits
    ours.train()
    torch.manual_seed(5)
    first = ours(ids, attention_mask=m).logits
    torch.manual_seed(5)
    again = ours(ids, attention_mask=m).logits
    assert torch.equal(first, again)  # torch's generator drives it
    assert (first - quiet).abs().max().item() > 1e-3
    first.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)


def test_bfloat16_as_close_as_sdpa():
    full_theirs, _ = pair("llama")
    theirs, ours = pair("llama", torch.bfloat16)
    ids, m = torch.randint(3, 100, (3, 11)), padding("right")
    exact = full_theirs(ids, attention_mask=m).logits
    keep = m.bool()
    err_theirs = (theirs(ids, attention_mask=m).logits.float() - exact)[keep].abs().max().item()
    err_ours = (ours(ids, attention_mask=m).logits.float() - exact)[keep].abs().max().item()
    assert err_ours <= 2 * err_theirs + 1e-3


class _Module(torch.nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.is_causal, self.num_key_value_groups = causal, 2


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_q", [1, 5, 8])
def test_no_mask_reads_is_causal_top_left(causal, num_q):
    """No mask: causality from module.is_causal, aligned as sdpa aligns it (a
    static cache's prefill: more keys than queries)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, num_q, 8, generator=g)
    k, v = (torch.randn(2, 2, 8, 8, generator=g) for _ in range(2))
    module = _Module(causal)
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    got, _ = amt.attention_function(module, q, k, v, None, scaling=0.3)
    assert got.shape == want.shape == (2, num_q, 4, 8)
    assert (want - got).abs().max().item() <= TOL


def _dense(fn, batch, q_len, kv_len, q_offset, kv_offset, attention_mask):
    return masking_utils.sdpa_mask(
        batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=fn, attention_mask=attention_mask,
        allow_is_causal_skip=False,
    )  # fmt: skip


LEFT = torch.tensor([3, 0])
PACKED = masking_utils.find_packed_sequence_indices(
    torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]] * 2)
)
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]] * 2)
MASKS = {
    "causal": (masking_utils.causal_mask_function, ("causal",)),
    "sliding": (masking_utils.sliding_window_causal_mask_function(3), ("causal", "window")),
    "chunked": (masking_utils.chunked_causal_mask_function(4, LEFT), ("causal", "segment_ids")),
    "bidirectional": (masking_utils.bidirectional_mask_function, ()),
    "band": (masking_utils.sliding_window_bidirectional_mask_function(2), ("window",)),
    "packed": (
        masking_utils.and_masks(
            masking_utils.remap_positions_for_packed_sequence(
                masking_utils.causal_mask_function, POSITIONS
            ),
            masking_utils.packed_sequence_mask_function(PACKED),
        ),
        ("causal", "segment_ids"),
    ),
    "image tokens": (  # a model's own overlay: kept as a function (a BlockMask)
        masking_utils.or_masks(
            masking_utils.causal_mask_function, lambda b, h, q, kv: (q < 4) & (kv < 4)
        ),
        ("mask_mod",),
    ),
}
# (batch, Q, K, q_offset, kv_offset): a forward; a static cache's prefill; a decode step
# in a dynamic cache, in a static one, and in a sliding window cache
SIZES = [(2, 10, 10, 0, 0), (2, 6, 10, 0, 0), (2, 1, 10, 9, 0), (2, 2, 14, 7, 0), (2, 1, 4, 9, 6)]


@pytest.mark.parametrize("pad", ["none", "right", "left"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", list(MASKS))
def test_mask_forms_mean_transformers_masks(kind, size, pad):
    """Each mask function of transformers, at each cache's offsets, as our
    forms: the same attention as its dense mask, and padding as lengths or
    segment ids (never a dense matrix)."""
    fn, names = MASKS[kind]
    batch, q_len, kv_len, q_off, kv_off = size
    if kind == "packed" and (q_len, q_off) != (10, 0):
        pytest.skip("transformers packs sequences only without a cache")
    total = kv_off + kv_len
    attention = torch.ones(batch, total, dtype=torch.bool)
    if pad == "right":
        attention[0, total - 3 :] = False
    elif pad == "left":
        attention[0, :3] = False
    dense = _dense(fn, batch, q_len, kv_len, q_off, kv_off, attention)
    made = amt.mask_function(batch, q_len, kv_len, q_off, kv_off, fn, attention)
    assert isinstance(made, amt.Mask) and made.shape == (batch, 1, q_len, kv_len)
    assert not {"mask", "bias"} & set(made.forms)
    if size == SIZES[0]:  # (a forward: the forms each function becomes)
        assert set(names) <= set(made.forms), made.forms
    if kind not in ("band", "image tokens"):  # (every cache's offsets: the same forms)
        assert "mask_mod" not in made.forms, made.forms
    kept = attention[:, kv_off : kv_off + (made.keys or kv_len)]
    if not bool(kept.all()) and "mask_mod" not in made.forms:  # (padding the keys kept)
        assert "valid_lens" in made.forms or "segment_ids" in made.forms
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, q_len, 8, generator=g)
    k, v = (torch.randn(batch, 2, kv_len, 8, generator=g) for _ in range(2))
    want = am.dot_product_attention(q, k, v, mask=dense)
    got, _ = amt.attention_function(_Module(True), q, k, v, made)
    assert (want.transpose(1, 2) - got).abs().max().item() <= TOL


def test_importing_attention_multi_imports_neither():
    code = (
        "import sys, attention_multi, attention_multi.integrations\n"
        "print(sorted(m for m in ('transformers', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_register_returns_the_name():
    assert amt.register("attention_multi_test") == "attention_multi_test"
    assert tf.AttentionInterface()["attention_multi_test"] is amt.attention_function
    with pytest.raises(ValueError, match="name"):
        amt.register("sdpa")
    np.testing.assert_equal(NAME, amt.DEFAULT_NAME)
