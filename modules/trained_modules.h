// The learned modules eviction policies evict with, found by type and by the policy they serve: a
// trainer's live modules (the periodic eval of a run in progress), or the ones `kvbound eval` loaded from
// the files its config names. Policies never know where a module came from.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <typeindex>
#include <utility>

namespace kvbound {

class TrainedModules {
 public:
  // `serves` names the base policy this module was trained for ("" = any policy that uses this type):
  // a latent memory trained under trimkv serves "trimkv+mem" only.
  template <class Module>
  void add(std::shared_ptr<const Module> module, const std::string& serves = "") {
    modules_[{std::type_index(typeid(Module)), serves}] = std::move(module);
  }
  // The module of this type that serves `serves`, else the one added for any policy, else null.
  template <class Module>
  std::shared_ptr<const Module> find(const std::string& serves = "") const {
    auto it = modules_.find({std::type_index(typeid(Module)), serves});
    if (it == modules_.end()) it = modules_.find({std::type_index(typeid(Module)), ""});
    return it == modules_.end() ? nullptr : std::static_pointer_cast<const Module>(it->second);
  }

 private:
  std::map<std::pair<std::type_index, std::string>, std::shared_ptr<const void>> modules_;
};

}  // namespace kvbound
