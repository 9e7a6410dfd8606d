"""Two small language models written with flax and optax alone (no torsh_jax imports).

Their parameters carry logical axis names (linen ``with_logical_partitioning``,
nnx ``out_sharding`` metadata), as a model written for GSPMD would.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

VOCAB, D, HEADS, HEAD_DIM, MLP, SEQ = 64, 32, 4, 8, 64, 16


def _init(names, scale=None):
    base = nn.initializers.normal(scale) if scale else nn.initializers.lecun_normal()
    return nn.with_logical_partitioning(base, names)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(use_bias=False)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=HEADS,
            qkv_features=HEADS * HEAD_DIM,
            use_bias=False,
            kernel_init=_init(("embed", "heads", "kv")),
            out_kernel_init=_init(("heads", "kv", "embed")),
        )(y, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        x = x + y
        y = nn.LayerNorm(use_bias=False)(x)
        y = nn.Dense(MLP, use_bias=False, kernel_init=_init(("embed", "mlp")))(y)
        y = nn.Dense(D, use_bias=False, kernel_init=_init(("mlp", "embed")))(nn.gelu(y))
        return x + y


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, embedding_init=_init(("vocab", "embed"), 1.0))(tokens)
        x = LinenBlock()(x)
        x = nn.LayerNorm(use_bias=False)(x)
        return nn.Dense(VOCAB, use_bias=False, kernel_init=_init(("embed", "vocab")))(x)


def linen_loss(params, tokens):
    logits = LinenLM().apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def linen_params(key):
    return LinenLM().init(key, jnp.zeros((1, SEQ - 1), jnp.int32))["params"]


class NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.embed = nnx.Param(
            nnx.initializers.normal(1.0)(rngs.params(), (VOCAB, D)),
            out_sharding=("vocab", "embed"),
            eager_sharding=False,
        )
        self.w_in = nnx.Param(
            init(rngs.params(), (D, MLP)), out_sharding=("embed", "mlp"), eager_sharding=False
        )
        self.w_out = nnx.Param(
            init(rngs.params(), (MLP, D)), out_sharding=("mlp", "embed"), eager_sharding=False
        )
        self.head = nnx.Param(
            init(rngs.params(), (D, VOCAB)), out_sharding=("embed", "vocab"), eager_sharding=False
        )

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        x = x + jax.nn.gelu(x @ self.w_in[...]) @ self.w_out[...]
        return x @ self.head[...]


def nnx_model(seed=0):
    return NnxLM(nnx.Rngs(seed))


def nnx_loss(graphdef):
    def loss(state, tokens):
        model = nnx.merge(graphdef, state)
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss
