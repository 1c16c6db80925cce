"""Tiled MLP: run each decoder layer's MLP over the sequence a tile of tokens at a time.

A gated MLP keeps three intermediate tensors per token for backward (gate output, activation, up output:
3 x intermediate x 2 bytes; 84 KiB per token for Llama-3.1-8B, more than all the rest of the layer). Here the
MLP's forward runs tile by tile without keeping any of them; backward recomputes one tile at a time and
backpropagates through it. What stays per layer is the MLP's input (hidden x 2 bytes per token); the working set
is one tile's intermediates, whatever the sequence length. The MLP is an elementwise function of each token, so
tiling over tokens is exact (tests/test_tiled_mlp.py: forward and every gradient against the plain MLP).
"""

from __future__ import annotations

import torch

from ..layers import find_decoder_layers

TILE_TOKENS = 2048  # fitune.memory.estimate.TILE_TOKENS models the same tile


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp, tile_tokens, x, *params):
        ctx.mlp, ctx.tile = mlp, tile_tokens
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(flat)
        with torch.no_grad():
            for start in range(0, flat.shape[0], tile_tokens):
                out[start:start + tile_tokens] = mlp(flat[start:start + tile_tokens])
        ctx.save_for_backward(x)
        return out.view_as(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if ctx.needs_input_grad[2] else None
        for start in range(0, flat.shape[0], ctx.tile):
            tile = flat[start:start + ctx.tile].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                y = ctx.mlp(tile)
            torch.autograd.backward(y, g[start:start + ctx.tile])  # parameter gradients accumulate
            if grad_x is not None:
                grad_x[start:start + ctx.tile] = tile.grad
        n_params = len(ctx.needs_input_grad) - 3
        return (None, None, grad_x.view_as(x) if grad_x is not None else None) + (None,) * n_params


def _tiled_no_grad(mlp, tile_tokens: int, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    for start in range(0, flat.shape[0], tile_tokens):
        out[start:start + tile_tokens] = mlp(flat[start:start + tile_tokens])
    return out.view_as(x)


def tile_mlp(mlp: torch.nn.Module, tile_tokens: int = TILE_TOKENS) -> None:
    """Make `mlp` run tiled (in place). Its trainable parameters still get their gradients."""
    plain_forward = mlp.forward

    class _Plain(torch.nn.Module):  # the untiled forward, called per tile
        def forward(self, x):
            return plain_forward(x)

    plain = _Plain()

    def forward(x):
        trainable = [p for p in mlp.parameters() if p.requires_grad]
        if x.numel() // x.shape[-1] <= tile_tokens:  # one tile: the plain MLP (fitune.memory models the same)
            return plain_forward(x)
        if not torch.is_grad_enabled():  # e.g. a checkpointed layer's first forward: tiles too, nothing is kept
            return _tiled_no_grad(plain, tile_tokens, x)
        if not (x.requires_grad or trainable):
            return plain_forward(x)
        # the trainable parameters are inputs of the Function so that it runs when only they need gradients
        return _TiledMLP.apply(plain, tile_tokens, x, *trainable)

    mlp.forward = forward


def enable_tiled_mlp(model, tile_tokens: int = TILE_TOKENS) -> int:
    """Tile the MLP of every decoder layer of a transformers causal LM (PEFT-wrapped or not). Returns the count."""
    n = 0
    for layer in find_decoder_layers(model):
        if hasattr(layer, "mlp"):
            tile_mlp(layer.mlp, tile_tokens)
            n += 1
    if not n:
        raise ValueError("no decoder layer with an `mlp` found to tile")
    return n
