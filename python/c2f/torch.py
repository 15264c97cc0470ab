"""c2f.torch: c2f inside a PyTorch model on the CPU (imports torch; ``import c2f`` alone does not).

    import c2f.torch
    model = c2f.torch.accelerate(model.eval())

``accelerate`` replaces, in place, every ``nn.MultiheadAttention`` and every module with the
coarse-to-fine attention article's structure (``coarse_attn.qkv_proj``, ``coarse_attn.out_proj``,
``fine_attn.q_proj``, ``fine_attn.kv_proj``, ``fine_attn.out_proj`` and a ``chunk_size``; with
``block_h``/``block_w`` and a ``relative_position_bias_table``: the 2-D variant) by an ``nn.Module`` that
calls c2f's layer on the same weights. The replacement keeps the original's parameters (the same tensor
objects), so ``model.state_dict()`` is unchanged; when they change (``load_state_dict``, an in-place edit,
``model.double()``), c2f's copy is reloaded before the next call. It computes no gradients: it refuses a
module in training mode and inputs that require grad, and it runs under ``torch.no_grad()``.

Differences from the modules it replaces, by design (docs/python.md): a query row with no key to attend
to gets zeros (``nn.MultiheadAttention`` gives NaN, the article's code a uniform average);
``nn.TransformerEncoder``'s nested-tensor fast path is not taken (its padded rows hold values, not zeros).
"""

import torch
from torch import nn

import c2f


class Unsupported(ValueError):
    """A module or a call that c2f.torch cannot run the way PyTorch would (the message says why)."""


def _dtype(module, where):
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float64}:
        raise Unsupported(f"{where}: c2f runs float32 or float64 parameters, got {sorted(map(str, dtypes))}")
    return str(dtypes.pop()).replace("torch.", "")


class _Accelerated(nn.Module):
    """What the replacements share: the original's parameters, buffers and children (so the state dict is
    the original's), the c2f layer built on them, and the checks of every call."""

    def __init__(self, original, where, make_layer):
        super().__init__()
        self._where, self._make_layer = where, make_layer
        for name, p in original._parameters.items():
            self._parameters[name] = p
        for name, b in original._buffers.items():
            self._buffers[name] = b
        for name, m in original._modules.items():
            self._modules[name] = m
        self._synced = None
        self.layer = None
        self.train(original.training)  # eval (accelerate refuses training mode); model.train() later is refused per call
        self._sync()

    def _signature(self):
        return tuple((t.dtype, t.data_ptr(), t._version) for t in self.state_dict(keep_vars=True).values())

    def _sync(self):
        """(Re)builds the c2f layer when the parameters changed since the last call."""
        signature = self._signature()
        if signature == self._synced:
            return
        dtype = _dtype(self, self._where)
        if self.layer is None or self.layer.dtype.name != dtype:
            self.layer = self._make_layer(dtype)
        with torch.no_grad():
            self.layer.load_state_dict(self.state_dict())
        self._synced = signature

    def _check(self, tensors):
        if self.training:
            raise Unsupported(f"{self._where} is in training mode: c2f runs inference only (call model.eval())")
        for name, t in tensors.items():
            if t is None:
                continue
            if t.requires_grad:
                raise Unsupported(f"{self._where}: {name} requires grad, and c2f computes no gradients (run the "
                                  f"model under torch.no_grad() or torch.inference_mode())")
            if t.device.type != "cpu":
                raise Unsupported(f"{self._where}: {name} is on {t.device}; c2f runs on the CPU")
        self._sync()

    def extra_repr(self):
        return f"c2f: {self.layer!r}"


def _keep(mask):
    """The article's masks (1 / True = keep) as a c2f mask."""
    return None if mask is None else c2f.keep((mask != 0).numpy())


class MultiheadAttention(_Accelerated):
    """nn.MultiheadAttention (eval mode) on c2f.MultiHeadAttention: the same forward signature and results."""

    def __init__(self, mha, where="nn.MultiheadAttention", num_threads=0):
        if mha.bias_k is not None or mha.add_zero_attn:
            raise Unsupported(f"{where}: add_bias_kv and add_zero_attn are not supported by c2f")
        options = dict(kdim=mha.kdim, vdim=mha.vdim, bias=mha.in_proj_bias is not None, num_threads=num_threads)
        super().__init__(mha, where, lambda dtype: c2f.MultiHeadAttention(mha.embed_dim, mha.num_heads, dtype=dtype,
                                                                          **options))
        self.embed_dim, self.num_heads, self.batch_first = mha.embed_dim, mha.num_heads, mha.batch_first
        self.kdim, self.vdim, self.head_dim, self.dropout = mha.kdim, mha.vdim, mha.head_dim, mha.dropout
        # torch's encoder layers take their fast path — which reads these weights and never calls self_attn —
        # only when this is True: False makes them call this module (and its output is the same).
        self._qkv_same_embed_dim = False

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True):
        self._check(dict(query=query, key=key, value=value))
        self_attention = key is query and value is query
        batched = query.dim() == 3
        if not batched:  # unbatched: (L, E) and a (S,) key padding mask
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E): c2f reads [N, L, E] (one copy)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        with torch.no_grad():
            kv = {} if self_attention else dict(key=key, value=value)
            masks = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask)
            if need_weights:
                y, w = self.layer.forward_with_weights(query, **kv, **masks, average_attn_weights=average_attn_weights)
                w = torch.from_numpy(w)
            else:
                y, w = self.layer(query, **kv, **masks), None
            y = torch.from_numpy(y)
        if not batched:
            return y[0], (None if w is None else w[0])
        return (y if self.batch_first else y.transpose(0, 1).contiguous()), w


class C2FAttention(_Accelerated):
    """The coarse-to-fine article's C2FAttention (eval mode) on c2f.C2FAttention: forward(x, coarse_mask=None,
    fine_mask=None), masks 1 / True = keep ([B, m, m] and [B, m, k, k]), as the article's module."""

    def __init__(self, module, where="C2FAttention", num_threads=0):
        d, heads = module.coarse_attn.qkv_proj.in_features, module.coarse_attn.n_heads
        super().__init__(module, where, lambda dtype: c2f.C2FAttention(d, heads, module.chunk_size, dtype=dtype,
                                                                      num_threads=num_threads))
        self.chunk_size = module.chunk_size

    def forward(self, x, coarse_mask=None, fine_mask=None):
        self._check(dict(x=x, coarse_mask=coarse_mask, fine_mask=fine_mask))
        with torch.no_grad():
            return torch.from_numpy(self.layer(x, attn_mask=_keep(coarse_mask), fine_attn_mask=_keep(fine_mask)))


class C2FAttention2D(_Accelerated):
    """The 2-D coarse-to-fine module (tests/reference/c2f2d_reference.py's structure) on c2f.C2FAttention2D:
    forward(x, H, W)."""

    def __init__(self, module, where="C2FAttention2D", num_threads=0):
        ca = module.coarse_attn
        d, heads = ca.qkv_proj.in_features, ca.n_heads
        options = dict(max_blocks_h=ca.max_blocks_h, max_blocks_w=ca.max_blocks_w,
                       relative_position_bias=ca.relative_position_bias_table is not None, num_threads=num_threads)
        super().__init__(module, where, lambda dtype: c2f.C2FAttention2D(d, heads, module.block_h, module.block_w,
                                                                        dtype=dtype, **options))
        self.block_h, self.block_w = module.block_h, module.block_w

    def forward(self, x, H, W):
        self._check(dict(x=x))
        with torch.no_grad():
            return torch.from_numpy(self.layer(x, H, W))


def _has(module, *paths):
    for path in paths:
        m = module
        for part in path.split("."):
            if not hasattr(m, part):
                return False
            m = getattr(m, part)
    return True


def _replacement(module, where, num_threads):
    """The c2f module that replaces `module`, or None when c2f has none for it."""
    if isinstance(module, nn.MultiheadAttention):
        kind = MultiheadAttention
    elif _has(module, "chunk_size", "coarse_attn.qkv_proj", "coarse_attn.out_proj", "coarse_attn.n_heads",
              "fine_attn.q_proj", "fine_attn.kv_proj", "fine_attn.out_proj"):
        kind = C2FAttention
    elif _has(module, "block_h", "block_w", "coarse_attn.qkv_proj", "coarse_attn.out_proj", "coarse_attn.n_heads",
              "coarse_attn.relative_position_bias_table", "coarse_attn.max_blocks_h", "fine_attn.q_proj",
              "fine_attn.kv_proj", "fine_attn.out_proj"):
        kind = C2FAttention2D
    else:
        return None
    if module.training:
        raise Unsupported(f"{where} is in training mode: c2f runs inference only (call model.eval() first)")
    try:
        return kind(module, where, num_threads)
    except ValueError as e:  # e.g. the structure matched but the parameters are not the layer's (strict load)
        if isinstance(e, Unsupported):
            raise
        raise Unsupported(f"{where}: c2f cannot run it: {e}") from e


def accelerate(model, num_threads=0):
    """Replaces, in place, every nn.MultiheadAttention and coarse-to-fine module of `model` (or `model`
    itself) by its c2f replacement; returns the model. The model must be in eval mode. num_threads: c2f's
    threads per call (0 = c2f.get_num_threads())."""
    if model.training:
        raise Unsupported(f"{type(model).__name__} is in training mode: c2f runs inference only (call model.eval() "
                          f"first)")
    root = _replacement(model, type(model).__name__, num_threads)
    if root is not None:
        return root

    def visit(parent, prefix):
        for name, child in list(parent.named_children()):
            where = f"{prefix}{name}"
            if isinstance(child, _Accelerated):
                continue
            new = _replacement(child, f"{where} ({type(child).__name__})", num_threads)
            if new is None:
                visit(child, where + ".")
            else:
                setattr(parent, name, new)

    visit(model, "")
    return model


def accelerated(model):
    """The names of the modules of `model` that run on c2f."""
    return [name for name, m in model.named_modules() if isinstance(m, _Accelerated)]
