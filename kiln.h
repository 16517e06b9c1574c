#pragma once
// Everything of Kiln in one include, as <torch/torch.h> is used: tensors and ops, autograd, every nn
// module and functional op, optimizers, schedules, clipping, gradient scaling, checkpoints, datasets and
// samplers, the CUDA runtime and streams. Programs that care about compile time include the headers they
// use instead (each is small).
//   #include <kiln/kiln.h>
//   using namespace kiln;
#include <kiln/autograd/checkpoint.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/gradcheck.h>
#include <kiln/core/autocast.h>
#include <kiln/core/data/data.h>
#include <kiln/core/data/pad_sequence.h>
#include <kiln/core/data/window_sampler.h>
#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>
#include <kiln/core/parallel.h>
#include <kiln/core/phase_timer.h>
#include <kiln/core/random.h>
#include <kiln/core/stateful.h>
#include <kiln/core/tensor.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>
#include <kiln/nn/modules.h>
#include <kiln/nn/per_sample_grad.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/clip_grad.h>
#include <kiln/optim/flat_parameters.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/kfac.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/sgd.h>
#include <kiln/optim/shampoo.h>
