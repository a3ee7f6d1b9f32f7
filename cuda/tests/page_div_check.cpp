// decode/page_div.h's division by the page size against the integer
// division: every divisor up to 5000 (dense and random dividends, multiples
// and their neighbours, the largest dividend), random 31-bit divisors and
// the powers of two +- 2. CPU only:
//   g++ -O2 -std=c++17 -Icuda/include -Icuda cuda/tests/page_div_check.cpp -o page_div_check
//   ./page_div_check
#include <cstdio>
#include <random>
#include "decode/page_div.h"
int main() {
  using jax_flash::decode::PageDiv;
  std::mt19937 rng(1);
  long bad = 0, n_checked = 0;
  auto check = [&](int d, int n) {
    PageDiv pd(d);
    ++n_checked;
    if (pd.div(n) != n / d) { if (bad++ < 5) std::printf("d %d n %d got %d\n", d, n, pd.div(n)); }
  };
  for (int d = 1; d <= 5000; ++d) {
    for (int n = 0; n < 20000; n += 1 + (n > 3000 ? 7 : 0)) check(d, n);
    for (int k = 0; k < 200; ++k) { int n = int(rng() & 0x7fffffff); check(d, n); check(d, n - n % d); check(d, n - n % d - 1 < 0 ? 0 : n - n % d - 1); }
    check(d, 0x7fffffff); check(d, 0x7fffffff - 0x7fffffff % d); check(d, (0x7fffffff - 0x7fffffff % d) - 1);
  }
  for (int k = 0; k < 200000; ++k) {
    int d = int(rng() & 0x7fffffff); if (d == 0) d = 1;
    int n = int(rng() & 0x7fffffff);
    check(d, n); int m = n - n % d; check(d, m); if (m > 0) check(d, m - 1);
  }
  for (int e = 0; e < 31; ++e) for (int dd = -2; dd <= 2; ++dd) { long d = (1L << e) + dd; if (d < 1 || d > 0x7fffffff) continue;
    for (int k = 0; k < 2000; ++k) { int n = int(rng() & 0x7fffffff); check(int(d), n); int m = n - n % int(d); check(int(d), m); if (m) check(int(d), m - 1);} }
  std::printf("%ld checked, %ld wrong\n", n_checked, bad);
  return bad != 0;
}
