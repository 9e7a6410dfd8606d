"""What the planner needs to know of a model: parameter counts by part, widths and FLOPs per token.

A :class:`ModelShape` describes a transformer as the planner sees it: an embedding, ``layers``
identical blocks and a head. Counts are exact when taken from parameter shapes
(:meth:`ModelShape.from_params`, :meth:`ModelShape.demo`). FLOPs per token: ``2 N`` forward for
``N`` matmul parameters (Kaplan et al. 2020, section 2.1), plus attention's
``2 · 2 · seq_len · d_attn`` per layer (scores and the weighted sum, no causal saving: Chowdhery et
al. 2022, PaLM, appendix B), and the backward pass twice the forward.

Example:
    >>> shape = ModelShape.demo("150m")
    >>> shape.layers, shape.d_model, f"{shape.param_count / 1e6:.0f} M"
    (8, 1024, '167 M')
    >>> f"{shape.train_flops_per_token(recompute=False) / 1e9:.2f} GFLOP"
    '0.90 GFLOP'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from torsh_jax.errors import PlanError

__all__ = ["ModelShape", "DEMO_SIZES", "parse_model"]

#: Demo language-model sizes by name: (d_model, layers); vocabulary 32,000, 1,024 tokens.
DEMO_SIZES = {"tiny": (64, 2), "150m": (1024, 8), "350m": (1024, 24), "1b": (2048, 16), "7b": (4096, 32)}
DEMO_VOCAB, DEMO_SEQ_LEN = 32_000, 1024


@dataclass(frozen=True)
class ModelShape:
    """A transformer as parts and widths.

    Attributes:
        embed_params: parameters before the blocks (token and position embeddings).
        layer_params: parameters of one block.
        layers: identical blocks.
        head_params: parameters after the blocks (final norm, output projection; a tied
            embedding counts once, in ``embed_params``).
        d_model: width of the hidden state between blocks.
        seq_len: tokens per example.
        vocab: vocabulary size (the head's output width).
        heads: attention heads (the tensor axis must divide them).
        mlp: MLP hidden width (the tensor axis must divide it).
        name: how the user named it.
        leaves: ``(path, shape)`` of every parameter, in ``jax.tree`` order (paths ``/``-joined as
            plan keys write them; :meth:`from_params` records them): what the planner lays out as
            the runtime does, to count compressed bytes and what the plan splits over ``tensor``
            (empty: unknown).
        layers_key: the top-level key of the stacked layers in :attr:`leaves`.
        head_keys: the top-level keys of the head's parameters in :attr:`leaves` (a tied embedding
            is the embedding's).
        tensor_blocks: the model is written with :mod:`torsh_jax.tensor` blocks (the demo model), so
            its activations between blocks can be split over ``tensor`` (sequence parallelism); the
            compiler partitions any other model over ``tensor`` on whole activations.
        tensor_counts: ``((key, counts), ...)``: such a model's collectives over ``tensor`` read
            from its compiled step (:func:`~torsh_jax.planner.tensor_counts.with_tensor_counts`).
    """

    embed_params: int
    layer_params: int
    layers: int
    head_params: int
    d_model: int
    seq_len: int
    vocab: int
    heads: int
    mlp: int
    name: str = "model"
    leaves: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), repr=False)
    layers_key: str = "layers"
    head_keys: tuple[str, ...] = ("head",)
    tensor_blocks: bool = True
    tensor_counts: tuple = field(default=(), repr=False)

    def counted(self, key) -> tuple | None:
        """The collectives over ``tensor`` read from the model's compiled step for ``key``
        (:mod:`~torsh_jax.planner.tensor_counts`), or ``None``."""
        return dict(self.tensor_counts).get(key)

    @property
    def signature(self) -> str:
        """The sizes that decide the demo model's compiled bytes (what a machine file's compiled
        gradients are of).

        Example:
            >>> ModelShape(10, 20, 2, 10, d_model=8, seq_len=4, vocab=16, heads=2, mlp=32).signature
            'd_model=8,layers=2,vocab=16,seq_len=4,heads=2,mlp=32,params=10+2x20+10'
        """
        sizes = f"d_model={self.d_model},layers={self.layers},vocab={self.vocab},seq_len={self.seq_len}"
        params = f"params={self.embed_params}+{self.layers}x{self.layer_params}+{self.head_params}"
        return f"{sizes},heads={self.heads},mlp={self.mlp},{params}"

    @property
    def param_count(self) -> int:
        return self.embed_params + self.layers * self.layer_params + self.head_params

    def forward_flops_per_token(self) -> float:
        """Matmul FLOPs of one token's forward pass: blocks, attention scores and the head."""
        matmul = self.layers * self.layer_params + self.vocab * self.d_model  # the head's projection
        attention = self.layers * 2 * 2 * self.seq_len * self.d_model
        return 2 * matmul + attention

    def train_flops_per_token(self, *, recompute: bool) -> float:
        """Forward + backward (twice the forward); ``recompute``: the blocks' forward runs again in
        the backward pass (remat, or ZeRO-3 gathering the layer again)."""
        forward = self.forward_flops_per_token()
        blocks = self.layers * (2 * self.layer_params + 4 * self.seq_len * self.d_model)
        return 3 * forward + (blocks if recompute else 0)

    def demo_config(self, *, layers: int | None = None):
        """The demo model's :class:`~torsh_jax.demo.model.LMConfig` of this shape (``layers``: another
        depth, for probes)."""
        widths = {"vocab": self.vocab, "seq_len": self.seq_len, "heads": self.heads, "mlp": self.mlp}
        return demo_config("custom", d_model=self.d_model, layers=layers or self.layers, **widths)

    @classmethod
    def from_params(
        cls,
        params,
        /,
        *,
        layers_key: str = "layers",
        head_keys: tuple[str, ...] = ("head",),
        tensor_blocks: bool = False,
        **widths,
    ) -> ModelShape:
        """From a layered model's parameters (arrays or shapes): ``params[layers_key]`` stacked on a
        leading dim, ``head_keys`` after the blocks, the rest before them; ``widths`` gives
        ``d_model``, ``seq_len``, ``vocab``, ``heads``, ``mlp``; ``tensor_blocks``: the model is
        written with :mod:`torsh_jax.tensor` blocks (:meth:`from_model` reads it from the model)."""
        import jax
        import numpy as np

        count = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
        stacked = params[layers_key]
        layers = jax.tree.leaves(stacked)[0].shape[0]
        head = count([params[k] for k in head_keys if k in params])
        embed = count([v for k, v in params.items() if k != layers_key and k not in head_keys])
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        path = lambda p: jax.tree_util.keystr(p, simple=True, separator="/")
        leaves = tuple((path(p), tuple(x.shape)) for p, x in flat)
        keys = {"layers_key": layers_key, "head_keys": tuple(head_keys), "tensor_blocks": tensor_blocks}
        return cls(embed, count(stacked) // layers, layers, head, leaves=leaves, **keys, **widths)

    @classmethod
    def from_model(cls, model, params, /, **widths) -> ModelShape:
        """From a :class:`~torsh_jax.runtime.layered.LayeredModel` (a flax model's: ``from_linen(...)
        .model``) and its parameters in the layered layout: its ``layers_key``, its head's keys (a
        key the embedding reads too, a tied embedding, counts once, before the blocks) and whether
        it is written with tensor blocks.

        Example:
            >>> import jax.numpy as jnp
            >>> from torsh_jax.runtime.layered import LayeredModel
            >>> model = LayeredModel(None, None, None, embed_keys=("wte",), head_keys=("ln_f", "wte"),
            ...                      layers_key="blocks")
            >>> params = {"wte": jnp.zeros((64, 8)), "blocks": {"w": jnp.zeros((2, 8, 8))},
            ...           "ln_f": jnp.zeros(8)}
            >>> s = ModelShape.from_model(model, params, d_model=8, seq_len=4, vocab=64, heads=1, mlp=8)
            >>> s.embed_params, s.layer_params, s.head_params, s.layers_key, s.tensor_blocks
            (512, 64, 8, 'blocks', False)
        """
        head = tuple(k for k in model.head_keys if k not in model.embed_keys)
        keys = {"layers_key": model.layers_key, "head_keys": head, "tensor_blocks": model.tensor_blocks}
        return cls.from_params(params, **keys, **widths)

    @classmethod
    def demo(cls, size: str = "150m", **overrides: int) -> ModelShape:
        """The demo language model (:mod:`torsh_jax.demo.model`) at a named size, exact counts."""
        import jax

        from torsh_jax.demo.model import init_params

        cfg = demo_config(size, **overrides)
        shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        widths = {"d_model": cfg.d_model, "seq_len": cfg.seq_len, "vocab": cfg.vocab, "heads": cfg.heads}
        return cls.from_params(shapes, mlp=cfg.mlp, name=f"demo:{size}", tensor_blocks=True, **widths)


def demo_config(size: str, **overrides: int):
    """The demo model's :class:`~torsh_jax.demo.model.LMConfig` at a named size (``150m``, ``1b``)
    or ``custom`` with ``d_model`` and ``layers`` given; unless ``heads`` and ``mlp`` are given,
    heads of 64 and an MLP 4 × d_model wide.

    Raises:
        PlanError: an unknown size, or heads that do not divide d_model.
    """
    from torsh_jax.demo.model import LMConfig

    if size not in DEMO_SIZES and size != "custom":
        raise PlanError(
            f"unknown demo size {size!r}",
            key="model",
            fix=f"use one of {', '.join(DEMO_SIZES)} or d_model=..,layers=..",
        )
    d_model, layers = DEMO_SIZES.get(size, (overrides.get("d_model", 1024), overrides.get("layers", 8)))
    d_model, layers = overrides.pop("d_model", d_model), overrides.pop("layers", layers)
    heads = overrides.pop("heads", max(1, d_model // 64))
    mlp = overrides.pop("mlp", 4 * d_model)
    if heads < 1 or d_model % heads:
        raise PlanError(
            f"{heads} heads do not divide d_model={d_model}",
            key="model",
            fix=f"give heads that divide {d_model} (e.g. {max(1, d_model // 64)}, heads of 64)",
        )
    fields = {"vocab": DEMO_VOCAB, "seq_len": DEMO_SEQ_LEN, **overrides}
    return LMConfig(d_model=d_model, heads=heads, head_dim=d_model // heads, mlp=mlp, layers=layers, **fields)


#: Fields a model description may give (``demo:d_model=4096,layers=32,mlp=11008``).
DESCRIPTION_FIELDS = ("d_model", "layers", "vocab", "seq_len", "heads", "mlp")


def parse_model(text: str, /) -> ModelShape:
    """``demo:1b``, ``demo:150m`` or ``demo:d_model=2048,layers=16[,vocab=..,seq_len=..,heads=..,mlp=..]``:
    the demo model at that shape.

    Example:
        >>> shape = parse_model("demo:d_model=512,layers=2,heads=4,mlp=1376")
        >>> shape.heads, shape.mlp, shape.layer_params == 4 * 512 * 512 + 2 * 512 * 1376 + 2 * 512
        (4, 1376, True)

    Raises:
        PlanError: another form, or an unknown size or field.
    """
    match = re.fullmatch(r"demo:(.+)", text.strip())
    if match is None:
        raise PlanError(
            f"cannot read model {text!r}",
            key="model",
            fix="write demo:150m, demo:1b or demo:d_model=1024,layers=8 (plan also takes MODULE:NAME)",
        )
    spec = match.group(1)
    if "=" not in spec:
        return ModelShape.demo(spec)
    fields = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key not in DESCRIPTION_FIELDS or not value.isdigit() or int(value) < 1:
            raise PlanError(
                f"cannot read {item!r} in {text!r}",
                key="model",
                fix=f"fields are {', '.join(DESCRIPTION_FIELDS)} with whole numbers above 0",
            )
        fields[key] = int(value)
    return replace(ModelShape.demo("custom", **fields), name=text.strip())
