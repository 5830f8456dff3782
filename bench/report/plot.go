// Package report holds what the benchmarks share in their reports: nearest-rank
// percentiles and cumulative-distribution charts drawn to PNG.
package report

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"slices"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// Series is one curve of a chart: its name in the legend and its values (ms).
type Series struct {
	Name   string
	Values []float64
	// P50 is shown beside the name.
	P50 float64
}

// Marker is a dashed vertical line, a floor or a target.
type Marker struct {
	Name string
	X    float64
}

// CDF draws the cumulative distribution of every series into a PNG at path.
func CDF(path, title, xlabel string, series []Series, markers ...Marker) error {
	const W, H = 960, 600
	const left, right, top, bottom = 80, 30, 50, 70
	img := image.NewRGBA(image.Rect(0, 0, W, H))
	fill(img, img.Bounds(), color.White)
	xmax := 0.0
	for _, s := range series {
		for _, v := range s.Values {
			xmax = max(xmax, v)
		}
	}
	for _, m := range markers {
		xmax = max(xmax, m.X)
	}
	xmax = niceCeil(xmax * 1.05)
	px := func(ms float64) int { return left + int(ms/xmax*float64(W-left-right)) }
	py := func(frac float64) int { return H - bottom - int(frac*float64(H-top-bottom)) }
	black, grey := color.RGBA{40, 40, 40, 255}, color.RGBA{150, 150, 150, 255}
	// Axes, grid and ticks.
	for i := 0; i <= 10; i++ {
		x := xmax * float64(i) / 10
		line(img, px(x), py(0), px(x), py(1), color.RGBA{230, 230, 230, 255}, 0)
		text(img, px(x)-12, py(0)+18, fmt.Sprintf("%.0f", x), black)
	}
	for i := 0; i <= 4; i++ {
		f := float64(i) / 4
		line(img, px(0), py(f), px(xmax), py(f), color.RGBA{230, 230, 230, 255}, 0)
		text(img, left-40, py(f)+4, fmt.Sprintf("%.2f", f), black)
	}
	line(img, px(0), py(0), px(xmax), py(0), black, 0)
	line(img, px(0), py(0), px(0), py(1), black, 0)
	text(img, W/2-150, H-25, xlabel, black)
	text(img, 10, top-20, title, black)
	colors := []color.RGBA{{31, 119, 180, 255}, {255, 127, 14, 255}, {44, 160, 44, 255}}
	for i, s := range series {
		c := colors[i%len(colors)]
		v := slices.Clone(s.Values)
		slices.Sort(v)
		prevX, prevY := px(0), py(0)
		for j, x := range v {
			x, y := px(x), py(float64(j+1)/float64(len(v)))
			line(img, prevX, prevY, x, prevY, c, 0)
			line(img, x, prevY, x, y, c, 0)
			prevX, prevY = x, y
		}
		text(img, W-right-260, top+20+18*i, fmt.Sprintf("%s (p50 %.1f ms)", s.Name, s.P50), c)
	}
	for i, m := range markers {
		line(img, px(m.X), py(0), px(m.X), py(1), grey, 6)
		text(img, W-right-260, top+20+18*(len(series)+i), fmt.Sprintf("%s (%.1f ms)", m.Name, m.X), grey)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return png.Encode(f, img)
}

func fill(img *image.RGBA, r image.Rectangle, c color.Color) {
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.Set(x, y, c)
		}
	}
}

// line draws a 2-pixel line; dash > 0 draws dashes of that length.
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.Color, dash int) {
	steps := max(abs(x1-x0), abs(y1-y0), 1)
	for i := 0; i <= steps; i++ {
		if dash > 0 && (i/dash)%2 == 1 {
			continue
		}
		x := x0 + (x1-x0)*i/steps
		y := y0 + (y1-y0)*i/steps
		img.Set(x, y, c)
		img.Set(x+1, y, c)
		img.Set(x, y+1, c)
	}
}

func text(img *image.RGBA, x, y int, s string, c color.Color) {
	d := font.Drawer{Dst: img, Src: image.NewUniform(c), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

// niceCeil rounds up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}
