// A message whose format string has another number of fields than the call has arguments does not
// compile in the default and library modes, where the headers' messages are counted instead of
// going through fmt's full check (detail/errors.hpp, CountedFormat); the all-inline mode keeps
// fmt's check. This file compiles itself in the default mode whatever the test build links.
// The second line pins the call: the one with one field and two arguments, not the good ones.
// expect-error: message_format_does_not_match_its_arguments
// expect-error: CountedFormat<2>
#undef EMAKIT_HEADER_ONLY
#include <emakit/detail/errors.hpp>

// Counted and accepted: automatic fields, a spec, escaped braces, positional fields.
void good(int a, double b) {
  if (a < 0) emakit::detail::fail("a {} and b {:.3g}, {{literal}}", a, b);
  if (a > 9) emakit::detail::fail("{1} before {0}, {1} again", a, b);
}

void bad(int a, int b) { emakit::detail::fail("a {} but no field for b", a, b); }
