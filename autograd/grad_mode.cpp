#include <kiln/autograd/anomaly.h>
#include <kiln/autograd/grad_mode.h>

namespace kiln::autograd {

namespace {
thread_local bool grad_enabled = true;
bool anomaly_enabled = false;
}  // namespace

bool is_grad_enabled() { return grad_enabled; }
void set_grad_enabled(bool enabled) { grad_enabled = enabled; }
bool is_anomaly_enabled() { return anomaly_enabled; }
void set_anomaly_enabled(bool enabled) { anomaly_enabled = enabled; }

}  // namespace kiln::autograd
