"""Numba's implementation of `kernel.prefetch_row`: LLVM's `prefetch` of every cache line of one
row of a 2-d array, registered when the first compiled loop is built (this module imports
Numba; `kernel` imports it only then).

The exact part of a decode step reads a few hundred short runs of keys and values (the visited
clusters, a few hundred rows each) from memory, one row after the other. The hardware's stream
prefetcher does not follow a run across a 4 KiB page (8 rows of 128 float32), so each thread
waited for most rows' cache lines; asking for the lines a few rows ahead keeps more of them in
flight (docs/benchmark-notes.md, "Prefetching the rows of the exact part")."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .kernel import prefetch_row

CACHE_LINE_BYTES = 64


@intrinsic
def _prefetch(typingctx, array, row, column):
    """`llvm.prefetch` (a read, kept in every cache level) of `&array[row, column]`."""
    signature = types.void(array, types.intp, types.intp)

    def codegen(context, builder, signature, arguments):
        array_type = signature.args[0]
        found, row, column = arguments
        view = context.make_array(array_type)(context, builder, found)
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [row, column])
        byte_pointer = builder.bitcast(pointer, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer.type, i32, i32, i32]),
            "llvm.prefetch.p0",
        )
        # read (0), the highest locality (3), data, not instructions (1)
        builder.call(function, [byte_pointer, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return signature, codegen


@overload(prefetch_row)
def _prefetch_row(array, row):
    step = max(1, CACHE_LINE_BYTES * 8 // array.dtype.bitwidth)  # elements per cache line

    def prefetch_every_line(array, row):
        for column in range(0, array.shape[1], step):
            _prefetch(array, row, column)

    return prefetch_every_line
