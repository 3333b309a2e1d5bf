package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// onInterrupt returns a context that SIGINT or SIGTERM cancels, and calls
// again (once) at the first later signal that comes more than minGap
// after the first one. stop releases the signals.
func onInterrupt(again func(), minGap time.Duration) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		if _, ok := <-sigs; !ok {
			return
		}
		cancel()
		first := time.Now()
		for {
			if _, ok := <-sigs; !ok {
				return
			}
			if time.Since(first) > minGap {
				again()
				return
			}
		}
	}()
	return ctx, func() {
		signal.Stop(sigs)
		close(sigs)
		cancel()
	}
}
