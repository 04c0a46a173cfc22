"""Fill each layer's tile-size maps (CPU, GPU single-core, GPU multi-core) with Loom's rules."""

from __future__ import annotations

from poly.layer import LayerType, VolumetricLayer
from poly.tiling import cpu_tile_sizes, gpu_tile_sizes

_KIND = {
    LayerType.DENSE: "dense",
    LayerType.MHA: "mha",
    LayerType.SWIGLU: "swiglu",
    LayerType.RMSNORM: "rmsnorm",
    LayerType.RESIDUAL: "residual",
    LayerType.EMBEDDING: "embedding",
    LayerType.SEQUENTIAL: "sequential",
}


def refresh_layer_tiles(layer: VolumetricLayer) -> None:
    dims = dict(
        d_model=layer.d_model,
        query_dim=layer.query_dim,
        kv_dim=layer.num_kv_heads * layer.head_dim,
        input_height=layer.input_height,
        output_height=layer.output_height,
        embedding_dim=layer.embedding_dim,
    )
    kind = _KIND[layer.type]
    layer.cpu_tile_sizes = cpu_tile_sizes(kind, **dims)
    layer.gpu_sc_tile_sizes, layer.gpu_mc_tile_sizes = gpu_tile_sizes(kind, head_dim=layer.head_dim)
