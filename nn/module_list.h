#pragma once
// Containers that own modules and register them, without a forward of their own (as torch.nn.ModuleList
// and ModuleDict): their children's parameters, buffers, state_dict paths ("layers.0.weight",
// "heads.query.weight") and hooks are the parent's like any child's.
//   nn::ModuleList layers;
//   for (int i = 0; i < 4; ++i) layers.emplace_back<Block>(width);
//   for (size_t i = 0; i < layers.size(); ++i) x = layers.at<Block>(i)(x);
//   nn::ModuleDict heads;
//   heads.insert("query", std::make_unique<nn::Linear>(64, 64));
//   y = heads["query"](x);
// Modules cannot be moved (registered pointers must stay valid), hence unique_ptr rather than values.
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

// Children named "0", "1", ... in order.
class ModuleList : public Module {
 public:
  ModuleList() = default;

  template <class M>
  M& push_back(std::unique_ptr<M> module) {
    KILN_CHECK(module != nullptr, "ModuleList::push_back: null module");
    M& ref = *module;
    owned_.reserve(owned_.size() + 1);  // nothing can throw between registering and owning
    register_module(std::to_string(owned_.size()), static_cast<Module&>(ref));
    owned_.push_back(std::move(module));
    return ref;
  }
  template <class M, class... Args>
  M& emplace_back(Args&&... args) {
    return push_back(std::make_unique<M>(std::forward<Args>(args)...));
  }

  size_t size() const { return owned_.size(); }
  bool empty() const { return owned_.empty(); }
  Module& operator[](size_t index) const {
    KILN_CHECK(index < owned_.size(), "ModuleList: index ", index, " out of range for ", owned_.size(), " modules");
    return *owned_[index];
  }
  // The child at `index` as an M; throws kiln::Error if it is something else.
  template <class M>
  M& at(size_t index) const {
    M* m = dynamic_cast<M*>(&(*this)[index]);
    KILN_CHECK(m != nullptr, "ModuleList::at: child ", index, " is a ", (*this)[index].name());
    return *m;
  }
  // A ModuleList has no forward: call its children.
  Tensor forward(const Tensor&) override { KILN_FAIL("ModuleList has no forward: call its modules"); }

 private:
  std::vector<std::unique_ptr<Module>> owned_;
};

// Children by name, in insertion order.
class ModuleDict : public Module {
 public:
  ModuleDict() = default;

  // Adds a child; the name is non-empty, has no '.' and is not taken.
  template <class M>
  M& insert(const std::string& name, std::unique_ptr<M> module) {
    KILN_CHECK(module != nullptr, "ModuleDict::insert: null module '", name, "'");
    KILN_CHECK(!contains(name), "ModuleDict::insert: '", name, "' is already a key");
    M& ref = *module;
    owned_.reserve(owned_.size() + 1);
    register_module(name, static_cast<Module&>(ref));  // checks the name
    owned_.emplace_back(name, std::move(module));
    return ref;
  }

  size_t size() const { return owned_.size(); }
  bool contains(const std::string& name) const {
    for (const auto& [n, m] : owned_)
      if (n == name) return true;
    return false;
  }
  Module& operator[](const std::string& name) const {
    for (const auto& [n, m] : owned_)
      if (n == name) return *m;
    KILN_FAIL("ModuleDict: no module named '", name, "'");
  }
  template <class M>
  M& at(const std::string& name) const {
    M* m = dynamic_cast<M*>(&(*this)[name]);
    KILN_CHECK(m != nullptr, "ModuleDict::at: '", name, "' is a ", (*this)[name].name());
    return *m;
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    for (const auto& [n, m] : owned_) k.push_back(n);
    return k;
  }
  Tensor forward(const Tensor&) override { KILN_FAIL("ModuleDict has no forward: call its modules"); }

 private:
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> owned_;
};

}  // namespace kiln::nn
