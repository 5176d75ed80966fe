"""A growing (rows, D) float32 matrix: preallocated when the final size is known."""

from __future__ import annotations

import numpy as np

from qkv.embeddings._vectors import FloatMatrix


class Rows:
    """Rows added block by block; :meth:`result` returns them as one (N, D) matrix.

    With a ``capacity`` (the header's count, a limit, or the wanted words), rows go straight
    into one preallocated matrix, so a file of N vectors needs memory for N vectors once;
    without one, blocks are joined at the end.
    """

    def __init__(self, dim: int, capacity: int | None) -> None:
        self.dim = dim
        self.filled = 0
        self.matrix = np.empty((capacity, dim), dtype=np.float32) if capacity else None
        self.overflow: list[FloatMatrix] = []

    def add(self, block: FloatMatrix) -> None:
        if self.matrix is not None and not self.overflow:
            room = self.matrix.shape[0] - self.filled
            head, block = block[:room], block[room:]
            self.matrix[self.filled : self.filled + len(head)] = head
            self.filled += len(head)
        if len(block):
            self.overflow.append(np.array(block, dtype=np.float32))

    def result(self) -> FloatMatrix:
        first = [] if self.matrix is None else [self.matrix[: self.filled]]
        if not self.overflow:
            if self.matrix is None:
                return np.empty((0, self.dim), dtype=np.float32)
            if self.filled == self.matrix.shape[0]:
                return self.matrix
            return self.matrix[: self.filled].copy()
        return np.concatenate([*first, *self.overflow])
