// Command connector-install copies kvhandoff's vLLM connector into the folder given as its
// argument: the init container of engines of a policy with executor Agent.
package main

import (
	"fmt"
	"os"

	vllmconnector "github.com/kvhandoff/kvhandoff/vllm-connector"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: install DIR")
		os.Exit(2)
	}
	if err := vllmconnector.Install(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("kvhandoff vLLM connector installed in", os.Args[1])
}
