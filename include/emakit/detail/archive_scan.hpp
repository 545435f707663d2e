// Moved: the serialization layer lives in detail/serial/ (see detail/serial/formats.hpp).
#pragma once

#include <emakit/detail/serial/archive_scan.hpp>
