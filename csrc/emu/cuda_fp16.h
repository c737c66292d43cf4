// The CUDA emulation (cuda_emu.h) stands in for <cuda_fp16.h> in the host build of the kernels.
#pragma once
#include "cuda_emu.h"
