package kvevents

import (
	"crypto/subtle"
	"net/http"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/keystream"
)

// Authorized serves next to requests bearing the token in tokenFile (read on each
// request, so a replaced Secret applies to the next follower), and 401 to any other.
// Only the routers and pickers that hold the Secret may follow an engine: the keys tell
// which prompts it holds to whoever can guess a prompt.
func Authorized(tokenFile string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		want, err := keystream.ReadToken(tokenFile)
		if err != nil {
			http.Error(w, "the sidecar has no token to check against", http.StatusInternalServerError)
			return
		}
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(want)) != 1 {
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, "a follower must present the pool's kv-events token", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}
