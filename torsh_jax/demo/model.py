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

import functools
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from torsh_jax import tensor
from torsh_jax.runtime.layered import LayeredModel, layered_loss
from torsh_jax.tensor.axis import TensorAxis

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
    """Token (vocabulary-parallel) plus position embedding; split on the sequence under SP."""

    cfg: LMConfig
    tp: TensorAxis = TensorAxis()

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        table = self.param(
            "embedding", nn.initializers.normal(0.02), (cfg.vocab // self.tp.size(), cfg.d_model)
        )
        pos = self.param("position", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
        # under sequence parallelism both are this device's chunk of the sequence
        return tensor.embed(tokens, table, tp=self.tp) + self.tp.split_sequence(pos[None, : tokens.shape[-1]])


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP: ``x[B, T, D] -> x[B, T, D]``.

    Heads and MLP features are split over the tensor axis (Megatron column/row pairs).
    """

    cfg: LMConfig
    tp: TensorAxis = TensorAxis()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        dense = nn.initializers.lecun_normal()
        heads, mlp = cfg.heads // self.tp.size(), cfg.mlp // self.tp.size()  # this device's share
        qkv_shape = (cfg.d_model, heads, cfg.head_dim)
        wq, wk, wv = (self.param(n, dense, qkv_shape) for n in ("wq", "wk", "wv"))
        wo = self.param("wo", dense, (heads, cfg.head_dim, cfg.d_model))
        w_in = self.param("w_in", dense, (cfg.d_model, mlp))
        w_out = self.param("w_out", dense, (mlp, cfg.d_model))
        attn_norm = self.param("attn_norm", nn.initializers.ones, (cfg.d_model,))
        mlp_norm = self.param("mlp_norm", nn.initializers.ones, (cfg.d_model,))
        x = x + tensor.attention(_rms_norm(x, attn_norm), wq, wk, wv, wo, tp=self.tp)
        return x + tensor.mlp(_rms_norm(x, mlp_norm), w_in, w_out, tp=self.tp)


class Head(nn.Module):
    """Final norm and the vocabulary-parallel output projection (local logits ``[B, T, V_t]``)."""

    cfg: LMConfig
    tp: TensorAxis = TensorAxis()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm = self.param("final_norm", nn.initializers.ones, (self.cfg.d_model,))
        vocab = self.cfg.vocab // self.tp.size()  # this device's share
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (self.cfg.d_model, vocab))
        return tensor.column(_rms_norm(x, norm), kernel, tp=self.tp)


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: LMConfig, key: jax.Array) -> dict:
    """Parameters ``{"embed", "layers" (stacked), "head"}`` in float32 (one compiled program: run
    op by op, the initialisers compile dozens of small ones)."""
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    hidden = jnp.zeros((1, cfg.seq_len, cfg.d_model), jnp.float32)
    embed = Embed(cfg).init(k_embed, tokens)["params"]
    block_init = lambda k: Block(cfg).init(k, hidden)["params"]
    layers = jax.vmap(block_init)(jax.random.split(k_layers, cfg.layers))
    head = Head(cfg).init(k_head, hidden)["params"]
    return {"embed": embed, "layers": layers, "head": head}


def layered_model(cfg: LMConfig, *, remat: bool = False, tp: TensorAxis | None = None) -> LayeredModel:
    """The model as embed -> stacked blocks -> head (next-token cross-entropy).

    Built from :mod:`torsh_jax.tensor` blocks (``tensor_blocks=True``): under a
    plan with ``tensor`` > 1 each device computes with its heads, MLP features and
    vocabulary rows; ``tp`` (default: the ``tensor`` axis, no sequence
    parallelism) says how.
    """
    tp = TensorAxis() if tp is None else tp
    return LayeredModel(
        embed=lambda p, batch: Embed(cfg, tp).apply({"params": p["embed"]}, batch["inputs"]),
        layer=lambda p, h: Block(cfg, tp).apply({"params": p}, h),
        head=lambda p, h, batch: tensor.cross_entropy(
            Head(cfg, tp).apply({"params": p["head"]}, h), batch["targets"], tp=tp
        ),
        remat=remat,
        tensor_blocks=True,
    )


def loss_fn(cfg: LMConfig, *, tp: TensorAxis | None = None):
    """``loss_fn(params, batch) -> mean next-token cross-entropy``."""
    return layered_loss(layered_model(cfg, tp=tp))


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
