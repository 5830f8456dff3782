package health

import (
	"testing"
	"time"
)

func TestFailedDeviceRecoversAfterItsQuietPeriod(t *testing.T) {
	now := time.Unix(1000, 0)
	tr := NewTracker(2 * time.Minute)
	tr.Now = func() time.Time { return now }
	if !tr.Healthy("gpu0") {
		t.Fatal("a device that never failed is unhealthy")
	}
	tr.Fail("gpu0")
	if tr.Healthy("gpu0") {
		t.Fatal("a device that just failed is healthy")
	}
	now = now.Add(119 * time.Second)
	if tr.Healthy("gpu0") {
		t.Fatal("healthy before the quiet period ended")
	}
	tr.Fail("gpu0") // fails again: the quiet period starts over
	now = now.Add(time.Minute)
	if tr.Healthy("gpu0") {
		t.Fatal("a second failure did not restart the quiet period")
	}
	now = now.Add(time.Minute)
	if !tr.Healthy("gpu0") {
		t.Fatal("not healthy after two quiet minutes")
	}
	if !tr.Healthy("gpu1") {
		t.Fatal("another device's failure leaked")
	}
}
