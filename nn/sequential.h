#pragma once
// Sequential: owns a list of modules and feeds each one's output to the next. Children are named "0",
// "1", ... (or as given), so parameter paths match PyTorch's ("0.weight").
//   nn::Sequential mlp(std::make_unique<nn::Linear>(784, 256), std::make_unique<nn::ReLU>(),
//                      std::make_unique<nn::Linear>(256, 10));
//   nn::Sequential net;
//   auto& fc = net.emplace_back<nn::Linear>(784, 256);  // returns the new layer
//   net.push_back(std::make_unique<nn::GELU>());
// Modules cannot be moved (registered pointers must stay valid), hence unique_ptr rather than values.
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

class Sequential : public Module {
 public:
  Sequential() = default;
  template <class... Ms>
  explicit Sequential(std::unique_ptr<Ms>... modules) {
    (push_back(std::move(modules)), ...);
  }

  // Appends a module named by its position; returns it.
  template <class M>
  M& push_back(std::unique_ptr<M> module) {
    return push_back(std::to_string(size()), std::move(module));
  }
  template <class M>
  M& push_back(const std::string& name, std::unique_ptr<M> module) {
    KILN_CHECK(module != nullptr, "Sequential::push_back: null module '", name, "'");
    M& ref = *module;
    owned_.reserve(owned_.size() + 1);  // so that nothing can throw between registering and owning
    register_module(name, static_cast<Module&>(ref));
    owned_.push_back(std::move(module));
    return ref;
  }
  // Constructs a module in place at the end: seq.emplace_back<nn::Linear>(784, 256).
  template <class M, class... Args>
  M& emplace_back(Args&&... args) {
    return push_back(std::make_unique<M>(std::forward<Args>(args)...));
  }

  // Runs the children in order (each through its own operator(), so their hooks fire).
  Tensor forward(const Tensor& x) override;

  size_t size() const { return named_children().size(); }
  bool empty() const { return size() == 0; }
  Module& operator[](size_t index) const;
  // The child at `index` as an M; throws kiln::Error if it is something else.
  template <class M>
  M& at(size_t index) const {
    M* m = dynamic_cast<M*>(&(*this)[index]);
    KILN_CHECK(m != nullptr, "Sequential::at: child ", index, " is a ", (*this)[index].name());
    return *m;
  }

 private:
  std::vector<std::unique_ptr<Module>> owned_;
};

}  // namespace kiln::nn
