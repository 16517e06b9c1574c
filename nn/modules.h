#pragma once
// Every nn module in one include, for programs that want them all. Libraries should include the
// headers they use (each is small), which keeps compile times down. Optimizers and clipping are in
// optim/ (<kiln/optim/clip_grad.h>); <kiln/kiln.h> includes all of Kiln.
#include <kiln/nn/activation.h>
#include <kiln/nn/batch_norm.h>
#include <kiln/nn/conv1d.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/dropout.h>
#include <kiln/nn/embedding.h>
#include <kiln/nn/flatten.h>
#include <kiln/nn/fp8_autocast.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/gpt.h>
#include <kiln/nn/init.h>
#include <kiln/nn/layer_norm.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/loss.h>
#include <kiln/nn/module.h>
#include <kiln/nn/module_list.h>
#include <kiln/nn/multihead_attention.h>
#include <kiln/nn/pooling.h>
#include <kiln/nn/rms_norm.h>
#include <kiln/nn/rotary_embedding.h>
#include <kiln/nn/sequential.h>
#include <kiln/nn/sk_conv2d.h>
#include <kiln/nn/sk_linear.h>
#include <kiln/nn/sketch.h>
