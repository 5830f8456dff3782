package discovery

import "context"

// Static is a source of one fixed set: a router embedded in a program (or a test) that
// knows its engines.
type Static struct{ Set *Set }

// Run sends the set once and waits for ctx to end.
func (s Static) Run(ctx context.Context, out chan<- *Set) error {
	select {
	case out <- s.Set:
	case <-ctx.Done():
	}
	<-ctx.Done()
	return nil
}
