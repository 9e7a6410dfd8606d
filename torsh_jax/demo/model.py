"""A small decoder-only transformer language model (flax linen), split into layers.

The model is written as three linen modules (embedding, one pre-norm block,
head) composed functionally: block parameters are stacked along a leading
``layers`` dim and applied with ``lax.scan``, so ZeRO-3 can gather one layer
at a time (see :class:`~torsh_jax.runtime.layered.LayeredModel`).

Example:
    >>> import jax
    >>> cfg = LMConfig(layers=2)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> params["layers"]["wq"].shape
    (2, 64, 4, 16)
    >>> batch = synthetic_tokens(cfg, batch_size=2, seed=0)
    >>> float(loss_fn(cfg)(params, batch)) > 0
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from torsh_jax.runtime.layered import LayeredModel, layered_loss

__all__ = ["LMConfig", "init_params", "layered_model", "loss_fn", "synthetic_tokens", "param_count"]


@dataclass(frozen=True)
class LMConfig:
    """Model size. Defaults give about 0.25 M parameters."""

    vocab: int = 256
    d_model: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp: int = 256
    layers: int = 4
    seq_len: int = 32


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(variance + 1e-6).astype(x.dtype)) * scale


class Embed(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        table = self.param("embedding", nn.initializers.normal(0.02), (cfg.vocab, cfg.d_model))
        pos = self.param("position", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
        return table[tokens] + pos[: tokens.shape[-1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP: ``x[B, T, D] -> x[B, T, D]``."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        dense = nn.initializers.lecun_normal()
        qkv_shape = (cfg.d_model, cfg.heads, cfg.head_dim)
        wq, wk, wv = (self.param(n, dense, qkv_shape) for n in ("wq", "wk", "wv"))
        wo = self.param("wo", dense, (cfg.heads, cfg.head_dim, cfg.d_model))
        w_in = self.param("w_in", dense, (cfg.d_model, cfg.mlp))
        w_out = self.param("w_out", dense, (cfg.mlp, cfg.d_model))
        attn_norm = self.param("attn_norm", nn.initializers.ones, (cfg.d_model,))
        mlp_norm = self.param("mlp_norm", nn.initializers.ones, (cfg.d_model,))

        h = _rms_norm(x, attn_norm)
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, w) for w in (wq, wk, wv))
        logits = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(cfg.head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        attended = jnp.einsum("bhqs,bshk->bqhk", weights, v)
        x = x + jnp.einsum("bthk,hkd->btd", attended, wo)
        h = _rms_norm(x, mlp_norm)
        return x + jax.nn.gelu(h @ w_in) @ w_out


class Head(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm = self.param("final_norm", nn.initializers.ones, (self.cfg.d_model,))
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (self.cfg.d_model, self.cfg.vocab))
        return _rms_norm(x, norm) @ kernel


def init_params(cfg: LMConfig, key: jax.Array) -> dict:
    """Parameters ``{"embed", "layers" (stacked), "head"}`` in float32."""
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    hidden = jnp.zeros((1, cfg.seq_len, cfg.d_model), jnp.float32)
    embed = Embed(cfg).init(k_embed, tokens)["params"]
    block_init = lambda k: Block(cfg).init(k, hidden)["params"]
    layers = jax.vmap(block_init)(jax.random.split(k_layers, cfg.layers))
    head = Head(cfg).init(k_head, hidden)["params"]
    return {"embed": embed, "layers": layers, "head": head}


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def layered_model(cfg: LMConfig, *, remat: bool = False) -> LayeredModel:
    """The model as embed -> stacked blocks -> head (next-token cross-entropy)."""
    return LayeredModel(
        embed=lambda p, batch: Embed(cfg).apply({"params": p["embed"]}, batch["inputs"]),
        layer=lambda p, h: Block(cfg).apply({"params": p}, h),
        head=lambda p, h, batch: _cross_entropy(Head(cfg).apply({"params": p["head"]}, h), batch["targets"]),
        remat=remat,
    )


def loss_fn(cfg: LMConfig):
    """``loss_fn(params, batch) -> mean next-token cross-entropy``."""
    return layered_loss(layered_model(cfg))


def param_count(params: dict) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def synthetic_tokens(cfg: LMConfig, *, batch_size: int, seed: int) -> dict:
    """A learnable synthetic batch: each token follows from the previous by a
    fixed random permutation, with 10% of positions resampled at random.

    Returns ``{"inputs": int32[B, T], "targets": int32[B, T]}`` as numpy arrays.
    """
    table = np.random.default_rng(1234).permutation(cfg.vocab)
    rng = np.random.default_rng(seed)
    seq = np.empty((batch_size, cfg.seq_len + 1), np.int32)
    seq[:, 0] = rng.integers(0, cfg.vocab, batch_size)
    for t in range(1, cfg.seq_len + 1):
        noise = rng.random(batch_size) < 0.1
        seq[:, t] = np.where(noise, rng.integers(0, cfg.vocab, batch_size), table[seq[:, t - 1]])
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:]}
