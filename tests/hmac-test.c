/*
 * hmac-test: daemon/fabric/hmac.c against the published vectors: SHA-256 of "", "abc" and a million
 * 'a' fed in uneven pieces (FIPS 180-2), and HMAC-SHA256 test cases 1 to 7 of RFC 4231 (case 5
 * truncated to 128 bits, as the RFC gives it).  Also the constant-time comparison.
 */
#include "config.h"

#include <stdio.h>
#include <string.h>

#include "daemon/fabric/internal.h"
#include "tests/tap.h"

static void
hex(const uint8_t *b, size_t n, char *out)
{
	for (size_t i = 0; i < n; i++)
		sprintf(out + 2 * i, "%02x", b[i]);
}

static void
sha_case(const char *what, const void *data, size_t len, const char *want)
{
	struct sha256 s;
	uint8_t d[SHA256_LEN];
	char h[2 * SHA256_LEN + 1];

	sha256_init(&s);
	sha256_update(&s, data, len);
	sha256_final(&s, d);
	hex(d, sizeof(d), h);
	ok(strcmp(h, want) == 0, "SHA-256 of %s: %s", what, h);
}

static void
hmac_case(int tc, const void *key, size_t klen, const void *data, size_t dlen, const char *want)
{
	uint8_t d[SHA256_LEN];
	char h[2 * SHA256_LEN + 1];

	hmac_sha256(key, klen, data, dlen, d);
	hex(d, sizeof(d), h);
	ok(strncmp(h, want, strlen(want)) == 0, "RFC 4231 test case %d: %.*s", tc, (int)strlen(want), h);
}

int
main(void)
{
	uint8_t k[131], dd[50];
	static char million[1000000];

	sha_case("\"\"", "", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
	sha_case("\"abc\"", "abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
	{
		struct sha256 s;
		uint8_t d[SHA256_LEN];
		char h[2 * SHA256_LEN + 1];
		memset(million, 'a', sizeof(million));
		sha256_init(&s);
		for (size_t off = 0, step = 1; off < sizeof(million); off += step, step = step * 3 % 997 + 1)
			sha256_update(&s, million + off, off + step > sizeof(million) ? sizeof(million) - off : step);
		sha256_final(&s, d);
		hex(d, sizeof(d), h);
		ok(strcmp(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0") == 0,
		    "SHA-256 of a million 'a' in uneven pieces: %s", h);
	}

	memset(k, 0x0b, 20);
	hmac_case(1, k, 20, "Hi There", 8, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
	hmac_case(2, "Jefe", 4, "what do ya want for nothing?", 28,
	    "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
	memset(k, 0xaa, 20);
	memset(dd, 0xdd, 50);
	hmac_case(3, k, 20, dd, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
	for (int i = 0; i < 25; i++)
		k[i] = (uint8_t)(i + 1);
	memset(dd, 0xcd, 50);
	hmac_case(4, k, 25, dd, 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
	memset(k, 0x0c, 20);
	hmac_case(5, k, 20, "Test With Truncation", 20, "a3b6167473100ee06e0c796c2955552b");
	memset(k, 0xaa, 131);
	hmac_case(6, k, 131, "Test Using Larger Than Block-Size Key - Hash Key First", 54,
	    "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
	const char *t7 = "This is a test using a larger than block-size key and a larger than block-size data. "
	    "The key needs to be hashed before being used by the HMAC algorithm.";
	hmac_case(7, k, 131, t7, strlen(t7), "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");

	uint8_t a[SHA256_LEN], b[SHA256_LEN];
	hmac_sha256("key", 3, "x", 1, a);
	memcpy(b, a, sizeof(b));
	ok(hmac_equal(a, b, sizeof(a)), "hmac_equal: equal tags");
	/* A difference in any one bit of any byte is a mismatch, wherever it lies: a comparison
	 * that looks at only some bytes (the first, the last) lets a forged proof through. */
	int missed = 0, extra = 0;
	for (size_t i = 0; i < sizeof(b); i++)
		for (int bit = 0; bit < 8; bit++) {
			b[i] ^= (uint8_t)(1u << bit);
			if (hmac_equal(a, b, sizeof(a)))
				missed++;
			b[i] ^= (uint8_t)(1u << bit);
		}
	ok(missed == 0, "hmac_equal: every one of the 256 single-bit differences is a mismatch (%d taken as equal)",
	    missed);
	/* And the length is the one given: bytes past it do not count, every byte before it does. */
	missed = 0;
	for (size_t len = 1; len <= sizeof(b); len++) {
		b[len - 1] ^= 0x80;
		if (hmac_equal(a, b, len))
			missed++;
		if (!hmac_equal(a, b, len - 1))
			extra++;
		b[len - 1] ^= 0x80;
	}
	ok(missed == 0 && extra == 0,
	    "hmac_equal over lengths 1 to 32: the last byte counts (%d missed), a byte past the length does not (%d)",
	    missed, extra);
	ok(hmac_equal(a, b, 0), "hmac_equal: two empty tags are equal");
	printf("1..%d\n", tap_count);
	return tap_failed ? 1 : 0;
}
