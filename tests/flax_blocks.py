"""Language models written the way their authors write them, with flax linen alone (no torsh_jax
imports): a GPT-2-style model (learned positions, LayerNorm, GELU MLP, tied embedding read back by
``attend``) whose blocks are a list made in ``setup``, and a Llama-style model (RMSNorm, rotary
positions, grouped-query attention, gated SiLU MLP, untied head) whose blocks are named children
made in ``__call__``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


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


def next_token_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
