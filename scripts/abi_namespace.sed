# Puts a header's emakit namespaces into the mode-tagged inline namespace (detail/config.hpp):
#   namespace emakit::detail {   ->  namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {
#   }  // namespace emakit::detail  ->  }  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
# Usage: sed -i -f scripts/abi_namespace.sed <header>...  (the file must include
# <emakit/detail/config.hpp> before its first namespace).
s/^\([[:space:]]*\)namespace emakit\(\(::[a-z_][a-z0-9_]*\)*\) {/\1namespace emakit::inline EMAKIT_ABI_NAMESPACE\2 {/
s|^\([[:space:]]*}[[:space:]]*//[[:space:]]*\)namespace emakit\(\(::[a-z_][a-z0-9_]*\)*\)[[:space:]]*$|\1namespace emakit::inline EMAKIT_ABI_NAMESPACE\2|
