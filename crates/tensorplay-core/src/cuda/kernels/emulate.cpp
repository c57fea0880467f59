// The launcher of the host emulation (see emulate.h): a registry of the kernels of
// tensorplay.cu by name, and a launch that runs every thread of every block in turn.
#define TP_EMULATE 1
#include <string.h>

#include "emulate.h"

thread_local tp_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace {
struct Entry {
    const char* name;
    tp_emu_entry entry;
};
Entry registry[256];
int registered = 0;
}  // namespace

tp_emu_register::tp_emu_register(const char* name, tp_emu_entry entry) {
    if (registered < 256) registry[registered++] = Entry{name, entry};
}

#include "tensorplay.cu"

// Runs kernel `name` on a grid of `grid` blocks of `block` threads with the parameter struct at
// `params`. Returns 0, or -1 when no kernel has that name.
extern "C" int tp_emu_launch(const char* name, const void* params, unsigned grid, unsigned block) {
    for (int k = 0; k < registered; ++k) {
        if (strcmp(registry[k].name, name) != 0) continue;
        gridDim = tp_dim3{grid, 1, 1};
        blockDim = tp_dim3{block, 1, 1};
        for (unsigned b = 0; b < grid; ++b) {
            for (unsigned t = 0; t < block; ++t) {
                blockIdx = tp_dim3{b, 0, 0};
                threadIdx = tp_dim3{t, 0, 0};
                registry[k].entry(params);
            }
        }
        return 0;
    }
    return -1;
}

// The number of registered kernels, and the name of the `i`-th (for the tests).
extern "C" int tp_emu_kernel_count() { return registered; }
extern "C" const char* tp_emu_kernel_name(int i) { return i < registered ? registry[i].name : 0; }
