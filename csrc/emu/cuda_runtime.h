// The CUDA emulation (cuda_emu.h) stands in for <cuda_runtime.h> in the host build of the kernels.
#pragma once
#include "cuda_emu.h"
