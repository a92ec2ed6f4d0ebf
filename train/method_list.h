// Every learned method, one line each: KVBOUND_METHOD(NAME) names the registration `methods::NAME` that
// train/NAME_method.cpp defines. Adding a method: its modules and loss, that file, and one line here.
// (No include guard: train/method_registry.cpp includes this list twice.)
KVBOUND_METHOD(trimkv)
KVBOUND_METHOD(indexmem)
KVBOUND_METHOD(memory)
KVBOUND_METHOD(joint)
