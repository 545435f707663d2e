// A module EMA of a module type that is not Cloneable, made without a factory, fails to compile
// with a message that names the fix (ModuleStorage's default constructor, storage.hpp): the EMA
// could only clone such a model, which it cannot, and would throw at run time. The second line
// pins where: the alias's default storage argument.
// expect-error: is not Cloneable.*give a factory.*emakit::module_ema
// expect-error: ModuleType = PlainImpl|ModuleStorage<PlainImpl>
#include <emakit/aliases.hpp>

#include <torch/nn/module.h>

struct PlainImpl : torch::nn::Module {};

void make(const PlainImpl& model) { emakit::ModuleEma<PlainImpl> ema(model); }
