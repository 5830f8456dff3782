package vllmserver

import (
	"fmt"
	"testing"
)

func TestOutputIsAFunctionOfThePromptForEveryPrompt(t *testing.T) {
	seen := map[string]bool{}
	for i := range 2000 {
		prompt := []string{fmt.Sprint(i), "x"}
		a, b := Output(prompt, 8), Output(prompt, 8)
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Fatalf("prompt %v: %v then %v", prompt, a, b)
		}
		seen[fmt.Sprint(a)] = true
	}
	if len(seen) < 1990 {
		t.Errorf("2000 prompts gave only %d distinct outputs: a test could not tell whose tokens a client got", len(seen))
	}
}
