"""The volumetric grid: a (depth, rows, cols, layers_per_cell) array of layer records."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import Activation, LayerType, VolumetricLayer
from poly.weights import Generations


class VolumetricNetwork:
    """Layers live in one flat list, index z*rows*cols*lpc + y*cols*lpc + x*lpc + l.
    The forward pass visits z, then y, x, l in that order and skips disabled layers."""

    def __init__(self, depth: int, rows: int, cols: int, layers_per_cell: int):
        dims = (depth, rows, cols, layers_per_cell)
        if any(not isinstance(d, int) or d <= 0 for d in dims):
            raise LayerConfigError(f"grid dimensions must be positive integers, got {dims}")
        self.depth, self.rows, self.cols, self.layers_per_cell = dims
        self.layers: list[VolumetricLayer] = []
        for z, y, x, l in self.coordinates():
            # Loom pre-fills every cell with an empty ReLU Dense layer.
            self.layers.append(
                VolumetricLayer(
                    type=LayerType.DENSE, activation=Activation.RELU, z=z, y=y, x=x, l=l
                )
            )

    def coordinates(self) -> Iterator[tuple[int, int, int, int]]:
        for z in range(self.depth):
            for y in range(self.rows):
                for x in range(self.cols):
                    for l in range(self.layers_per_cell):  # noqa: E741
                        yield z, y, x, l

    def index(self, z: int, y: int, x: int, l: int) -> int:  # noqa: E741
        if not (
            0 <= z < self.depth
            and 0 <= y < self.rows
            and 0 <= x < self.cols
            and 0 <= l < self.layers_per_cell
        ):
            raise LayerConfigError(f"grid coordinate {(z, y, x, l)} is outside {self.shape}")
        lpc = self.layers_per_cell
        return z * self.rows * self.cols * lpc + y * self.cols * lpc + x * lpc + l

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.depth, self.rows, self.cols, self.layers_per_cell

    def get_layer(self, z: int, y: int, x: int, l: int) -> VolumetricLayer:  # noqa: E741
        return self.layers[self.index(z, y, x, l)]

    def set_layer(self, z: int, y: int, x: int, l: int, layer: VolumetricLayer) -> None:  # noqa: E741
        layer.z, layer.y, layer.x, layer.l = z, y, x, l
        self.layers[self.index(z, y, x, l)] = layer
        Generations.bump()

    def forward(self, x: np.ndarray) -> np.ndarray:
        for layer in self.layers:
            if not layer.is_disabled:
                x = layer.forward(x)
        return x

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def walk(self) -> Iterator[VolumetricLayer]:
        for layer in self.layers:
            yield from layer.walk()

    def enable_tiling(self, tile_size: int = 0) -> None:
        """Turn on the tiled paths; tile_size <= 0 takes each layer's CPU tile for its dtype."""
        self.refresh_runtime_tile_sizes()
        for layer in self.walk():
            layer.use_tiling = True
            layer.tile_size = (
                tile_size if tile_size > 0 else layer.cpu_tile_sizes.get(layer.dtype, 8)
            )

    def disable_tiling(self) -> None:
        for layer in self.walk():
            layer.use_tiling = False

    def refresh_runtime_tile_sizes(self) -> None:
        from poly.tiling_maps import refresh_layer_tiles

        for layer in self.walk():
            refresh_layer_tiles(layer)
