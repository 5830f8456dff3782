package main

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
)

// The Dockerfile builds the same images as make images: for each image of the table, a
// build line with its package, cgo setting and linker flags, and a target of its name on
// its base, with its packages, binary, user and entrypoint. A Dockerfile edited alone
// fails here.
func TestTheDockerfileBuildsTheImagesOfTheTable(t *testing.T) {
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	targets := map[string]string{}
	from := regexp.MustCompile(`(?m)^FROM (\S+) AS (\S+)$`)
	all := from.FindAllStringSubmatchIndex(df, -1)
	for i, m := range all {
		end := len(df)
		if i+1 < len(all) {
			end = all[i+1][0]
		}
		targets[df[m[4]:m[5]]] = df[m[0]:end]
	}
	for _, img := range Images {
		stage, ok := targets[img.Name]
		if !ok {
			t.Errorf("%s: no Dockerfile target", img.Name)
			continue
		}
		cgo := map[bool]string{false: "CGO_ENABLED=0", true: "CGO_ENABLED=1"}[img.CGO]
		var want []string
		for _, p := range append([]Program{{img.Package, img.Binary}}, img.Also...) {
			bin := p.Binary[1:]
			build := regexp.MustCompile(`(?m)^RUN .*` + regexp.QuoteMeta(cgo) + `.* go build -trimpath -ldflags "` + regexp.QuoteMeta(img.LDFlags("${VERSION}")) +
				`" -o /out/` + regexp.QuoteMeta(bin) + ` ` + regexp.QuoteMeta(p.Package) + `$`)
			if !build.MatchString(df) {
				t.Errorf("%s: no build line `%s go build -trimpath -ldflags %q -o /out/%s %s`", img.Name, cgo, img.LDFlags("${VERSION}"), bin, p.Package)
			}
			want = append(want, fmt.Sprintf("COPY --from=build /out/%s %s\n", bin, p.Binary))
		}
		want = append(want,
			fmt.Sprintf("FROM %s AS %s\n", img.Base, img.Name),
			fmt.Sprintf("ENTRYPOINT [%q]\n", img.Binary),
		)
		if img.User != "" {
			want = append(want, "USER "+img.User+"\n")
		} else if strings.Contains(stage, "\nUSER ") {
			t.Errorf("%s: the Dockerfile sets a USER, the table none", img.Name)
		}
		if len(img.Packages) > 0 {
			want = append(want, "apt-get install -y -qq --no-install-recommends "+strings.Join(img.Packages, " ")+" ")
		}
		for _, w := range want {
			if !strings.Contains(stage, w) {
				t.Errorf("%s: the Dockerfile's target lacks %q", img.Name, strings.TrimSpace(w))
			}
		}
	}
	if len(targets) != len(Images)+1 {
		t.Errorf("the Dockerfile has %d targets beside its build stage, the table %d images", len(targets)-1, len(Images))
	}
}
