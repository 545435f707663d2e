// Moved: the checksum of every emakit file is detail/serial/checksum.hpp.
#pragma once

#include <emakit/detail/serial/checksum.hpp>
