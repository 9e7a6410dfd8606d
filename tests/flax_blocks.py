"""Language models written the way their authors write them, with flax alone (no torsh_jax
imports): a GPT-2-style model (learned positions, LayerNorm, GELU MLP, tied embedding read back by
``attend``) and a Llama-style model (RMSNorm, rotary positions, grouped-query attention, gated SiLU
MLP, untied head). In linen the GPT-2-style blocks are a list made in ``setup``, the Llama-style
ones named children made in ``__call__``; in nnx the GPT-2-style blocks are an ``nnx.List``, the
Llama-style ones a scanned stack (``nnx.vmap`` + ``nnx.scan``).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class GPT2Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        y = nn.LayerNorm(name="ln_1")(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(y, mask=mask)
        y = nn.LayerNorm(name="ln_2")(x)
        y = nn.Dense(4 * d, name="c_fc")(y)
        return x + nn.Dense(d, name="c_proj")(nn.gelu(y))


class GPT2(nn.Module):
    vocab: int
    d_model: int
    heads: int
    layers: int
    max_len: int

    def setup(self):
        self.wte = nn.Embed(self.vocab, self.d_model)
        self.wpe = nn.Embed(self.max_len, self.d_model)
        self.blocks = [GPT2Block(self.heads) for _ in range(self.layers)]
        self.ln_f = nn.LayerNorm()

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln_f(x))


def rotary(x, positions, base=10_000.0):
    """Rotate the halves of each head's features by position-dependent angles."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = (positions[:, None] * freq[None, :]).astype(x.dtype)
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class LlamaBlock(nn.Module):
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        batch, length, d = x.shape
        h = nn.RMSNorm(name="attention_norm")(x)
        q = nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name="wq")(h)
        k = nn.DenseGeneral((self.kv_heads, self.head_dim), use_bias=False, name="wk")(h)
        v = nn.DenseGeneral((self.kv_heads, self.head_dim), use_bias=False, name="wv")(h)
        positions = jnp.arange(length, dtype=jnp.float32)
        q, k = rotary(q, positions), rotary(k, positions)
        groups = self.heads // self.kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        x = x + nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="wo")(attended)
        h = nn.RMSNorm(name="ffn_norm")(x)
        gate = nn.Dense(self.hidden, use_bias=False, name="w1")(h)
        up = nn.Dense(self.hidden, use_bias=False, name="w3")(h)
        return x + nn.Dense(d, use_bias=False, name="w2")(nn.silu(gate) * up)


class Llama(nn.Module):
    vocab: int
    d_model: int
    heads: int
    kv_heads: int
    layers: int
    hidden: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model, name="tok_embeddings")(tokens)
        head_dim = self.d_model // self.heads
        for i in range(self.layers):
            x = LlamaBlock(self.heads, self.kv_heads, head_dim, self.hidden, name=f"layers_{i}")(x)
        x = nn.RMSNorm(name="norm")(x)
        return nn.Dense(self.vocab, use_bias=False, name="output")(x)


class HFAttention(nn.Module):
    """Grouped-query attention with flat projections (``q_proj`` is ``[d, heads * head_dim]``)."""

    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x):
        batch, length, d = x.shape
        head_dim = d // self.heads
        split = lambda y, n: y.reshape(batch, length, n, head_dim)
        q = split(nn.Dense(self.heads * head_dim, use_bias=False, name="q_proj")(x), self.heads)
        k = split(nn.Dense(self.kv_heads * head_dim, use_bias=False, name="k_proj")(x), self.kv_heads)
        v = split(nn.Dense(self.kv_heads * head_dim, use_bias=False, name="v_proj")(x), self.kv_heads)
        positions = jnp.arange(length, dtype=jnp.float32)
        q, k = rotary(q, positions), rotary(k, positions)
        groups = self.heads // self.kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, d)
        return nn.Dense(d, use_bias=False, name="o_proj")(attended)


class HFMLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(self.hidden, use_bias=False, name="gate_proj")(x)
        up = nn.Dense(self.hidden, use_bias=False, name="up_proj")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.silu(gate) * up)


@dataclasses.dataclass(frozen=True)
class HFConfig:
    vocab: int
    d_model: int
    heads: int
    kv_heads: int
    layers: int
    hidden: int


class HFDecoderLayer(nn.Module):
    config: HFConfig

    def setup(self):
        self.input_layernorm = nn.RMSNorm()
        self.self_attn = HFAttention(self.config.heads, self.config.kv_heads)
        self.post_attention_layernorm = nn.RMSNorm()
        self.mlp = HFMLP(self.config.hidden)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class HFLayerCollection(nn.Module):
    config: HFConfig

    def setup(self):
        self.blocks = [HFDecoderLayer(self.config, name=str(i)) for i in range(self.config.layers)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class HFLlamaModel(nn.Module):
    config: HFConfig

    def setup(self):
        self.embed_tokens = nn.Embed(self.config.vocab, self.config.d_model)
        self.layers = HFLayerCollection(self.config)
        self.norm = nn.RMSNorm()

    def __call__(self, tokens):
        return self.norm(self.layers(self.embed_tokens(tokens)))


class HFLlamaForCausalLM(nn.Module):
    """The module layout of Hugging Face's Flax Llama: the blocks at ``model/layers/0 ...``, flat
    ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and ``gate_proj``/``up_proj``/``down_proj``."""

    config: HFConfig

    def setup(self):
        self.model = HFLlamaModel(self.config)
        self.lm_head = nn.Dense(self.config.vocab, use_bias=False)

    def __call__(self, tokens):
        return self.lm_head(self.model(tokens))


def next_token_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


# ---------------------------------------------------------------- nnx


class NnxLlamaBlock(nnx.Module):
    def __init__(self, d, heads, kv_heads, hidden, rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.attention_norm = nnx.RMSNorm(d, rngs=rngs)
        self.wq = nnx.LinearGeneral(d, (heads, self.head_dim), use_bias=False, rngs=rngs)
        self.wk = nnx.LinearGeneral(d, (kv_heads, self.head_dim), use_bias=False, rngs=rngs)
        self.wv = nnx.LinearGeneral(d, (kv_heads, self.head_dim), use_bias=False, rngs=rngs)
        self.wo = nnx.LinearGeneral((heads, self.head_dim), d, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.w1 = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.w3 = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.w2 = nnx.Linear(hidden, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        length = x.shape[1]
        h = self.attention_norm(x)
        positions = jnp.arange(length, dtype=jnp.float32)
        q, k = rotary(self.wq(h), positions), rotary(self.wk(h), positions)
        groups = self.heads // self.kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(self.wv(h), groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        x = x + self.wo(jnp.einsum("bhqk,bkhd->bqhd", probs, v))
        h = self.ffn_norm(x)
        return x + self.w2(nnx.silu(self.w1(h)) * self.w3(h))


class NnxLlama(nnx.Module):
    """Blocks made by ``nnx.vmap`` (one stack, a leading layer dim) and run by ``nnx.scan``."""

    def __init__(self, vocab, d, heads, kv_heads, layers, hidden, rngs):
        self.tok_embeddings = nnx.Embed(vocab, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return NnxLlamaBlock(d, heads, kv_heads, hidden, rngs)

        self.layers = make_blocks(rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.output = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok_embeddings(tokens)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run_blocks(x, block):
            return block(x)

        return self.output(self.norm(run_blocks(x, self.layers)))


class NnxGPT2Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln_1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(d, rngs=rngs)
        self.c_fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.c_proj = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.c_proj(nnx.gelu(self.c_fc(self.ln_2(x))))


class NnxGPT2(nnx.Module):
    """Blocks in an ``nnx.List``, run one after the other; the token table read back by ``attend``."""

    def __init__(self, vocab, d, heads, layers, max_len, rngs):
        self.wte = nnx.Embed(vocab, d, rngs=rngs)
        self.wpe = nnx.Embed(max_len, d, rngs=rngs)
        self.blocks = nnx.List([NnxGPT2Block(d, heads, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln_f(x))


class NnxCausalLM(nnx.Module):
    """A decoder kept one module down (``transformer``) beside a learned logit scale, as Hugging
    Face nests its models: the decoder's blocks are at ``transformer/blocks`` (or ``/layers``)."""

    def __init__(self, decoder: nnx.Module):
        self.transformer = decoder
        self.logit_scale = nnx.Param(jnp.ones(()))

    def __call__(self, tokens):
        return self.transformer(tokens) * self.logit_scale
